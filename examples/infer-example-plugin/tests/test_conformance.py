"""infer's conformance suites, run on this distribution's plugins through the registry, as installed."""

from infer.testing import AllocatorConformance, SchedulerConformance


class TestSJF(SchedulerConformance):
    impl_name = "sjf"


class TestStack(AllocatorConformance):
    impl_name = "stack"
