"""The suite's pytest set-up: dsec's test kit is opt-in (as pytester is), and this repository
opts in for its own tests and every plugin's."""

pytest_plugins = ["dsec_core.testing"]
