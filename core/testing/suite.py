"""What every conformance suite shares: finding the implementation under test, its config, and its capabilities."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase
from pydantic import BaseModel

from infer.host import cache_dir
from infer.registry import get_registry

# Failing examples are kept in infer's cache directory, not in a .hypothesis/ folder of the working directory (a
# read-only checkout, as CI's can be, failed there).
EXAMPLE_DATABASE = DirectoryBasedExampleDatabase(str(cache_dir() / "hypothesis"))


class ConformanceSuite:
    """Base of the per-kind suites. A subclass names its implementation in one of two ways:

    - ``impl_name = "mine"``: loaded through the plugin registry, so the test also proves the entry point, the
      registration and the lazy import work as an installed user would see them;
    - overriding the kind's ``*_factory`` fixture method to construct the class directly.

    Capability flags (listed in ``capability_flags``) are class attributes a test class may change; an implementation
    class that declares the same attribute overrides them, so the registry sweep learns it too.
    ``expected_failures`` maps a test name to the reason it is known to fail: the test becomes a strict xfail.
    """

    pytestmark = pytest.mark.infer_conformance
    kind: ClassVar[str]
    impl_name: ClassVar[str | None] = None
    capability_flags: ClassVar[tuple[str, ...]] = ()
    expected_failures: ClassVar[dict[str, str]] = {}
    hypothesis_settings: ClassVar[settings] = settings(
        max_examples=30, stateful_step_count=25, deadline=None, database=EXAMPLE_DATABASE
    )

    def load_implementation(self, name: str | None) -> type:
        """The class registered as ``name`` for this suite's kind; adopts the capability flags it declares."""
        if name is None:
            pytest.fail(
                f"{type(self).__name__}: set impl_name to a registered {self.kind} name, "
                f"or override the factory fixture to construct your {self.kind} directly",
                pytrace=False,
            )
        implementation = get_registry().load(self.kind, name)
        for flag in self.capability_flags:
            if hasattr(implementation, flag):
                setattr(self, flag, getattr(implementation, flag))
        return implementation

    def implementation_config(self, name: str, **values: Any) -> BaseModel:
        """The registered config model of ``name``, with ``values`` for the fields it has (others keep defaults)."""
        model = get_registry().config_model(self.kind, name)
        fields = {"name": name, **values}
        return model(**{key: value for key, value in fields.items() if key in model.model_fields})
