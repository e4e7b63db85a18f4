"""The operators Kato can tune."""

from __future__ import annotations

from fastapi import APIRouter
from kato.kernels import list_operators
from kato.service.schemas import OperatorPublic, error_responses, plain
from kato.service.strict import StrictJSONRoute
from kato.service.validation import operator_or_404

router = APIRouter(prefix="/v1/operators", tags=["operators"], route_class=StrictJSONRoute)


@router.get("")
def get_operators() -> list[OperatorPublic]:
    """Every registered operator: dtypes, rank, parameter space, version."""
    return [OperatorPublic(**plain(spec.describe())) for spec in list_operators()]


@router.get("/{name}", responses=error_responses(e404="no such operator"))
def get_operator(name: str) -> OperatorPublic:
    """One operator (404 lists the known ones)."""
    return OperatorPublic(**plain(operator_or_404(name).describe()))
