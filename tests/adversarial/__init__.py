"""The adversarial suite as a package, so its modules may share names with the core tests'
(``adversarial.test_api`` beside ``test_api``)."""
