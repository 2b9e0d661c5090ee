"""Jobs and message consumers: the claim core driven by a function call (`decorator`) or a broker
delivery (`consumers`) instead of an HTTP request. The public names live here."""

from ..errors import InProgress, JobError, KeyReused, OutcomeUnknown, ResultNotStorable
from .decorator import Job, JobClaim, claim, current_job, idempotent, stored_result

__all__ = [
    "InProgress",
    "Job",
    "JobClaim",
    "JobError",
    "KeyReused",
    "OutcomeUnknown",
    "ResultNotStorable",
    "claim",
    "current_job",
    "idempotent",
    "stored_result",
]
