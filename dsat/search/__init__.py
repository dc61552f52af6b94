"""The search core: pure search methods that decide which DeepSpeed configuration to try next."""

from dsat.search.asha import AshaSearch
from dsat.search.binary import BinarySearch
from dsat.search.guided import GuidedSearch
from dsat.search.method import DsatSearchMethod
from dsat.search.method_settings import MethodSettings
from dsat.search.random import RandomSearch
from dsat.search.trial_builder import SearchSpec

# Keyed by each class's own name; dsat.experiment.settings.SEARCH_METHODS lists the names for the CLI.
METHODS: dict[str, type[DsatSearchMethod]] = {
    method.name: method for method in (GuidedSearch, AshaSearch, BinarySearch, RandomSearch)
}


def make_search_method(settings: MethodSettings, spec: SearchSpec) -> DsatSearchMethod:
    """The search method the settings name, ready to drive."""
    return METHODS[settings.method](settings, spec)


__all__ = [
    "METHODS",
    "AshaSearch",
    "BinarySearch",
    "DsatSearchMethod",
    "GuidedSearch",
    "MethodSettings",
    "RandomSearch",
    "SearchSpec",
    "make_search_method",
]
