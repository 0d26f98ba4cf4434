"""The whole-system checker: every role together under seeded fault schedules."""
