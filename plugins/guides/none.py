"""``guide: none``: no constrained decoding; a request with a constraint is refused, naming the guides that serve it."""

from __future__ import annotations

from infer.guide import Guide, GuideError


class NoGuide(Guide):
    """Serves no constraint; unconstrained requests are untouched."""

    supported_kinds = frozenset()

    def _compile(self, constraint):
        raise GuideError(
            f"this request asks for a {constraint.kind} constraint but guide.name is none; start the "
            f"engine with guide.name=xgrammar or guide.name=llguidance "
            f'(pip install "infer[xgrammar]" or "infer[llguidance]")'
        )

    def compile(self, constraint):
        return self._compile(constraint)

    def matcher(self, compiled):
        raise GuideError("guide none makes no matchers")
