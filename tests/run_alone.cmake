# Included by ctest after the discovered tests (TEST_INCLUDE_FILES, tests/CMakeLists.txt).
# A test whose pass/fail figure is a wall-clock latency that an issue names runs alone, never beside a
# training run on the same cores: #23's "a wrong key, an unknown host or another version is refused in
# under 10 s" took 4.4 s here beside two busy loops, and failed in a clean-clone CI run beside a
# three-executor training test. (Every other timing is recorded, never asserted.)
set_tests_properties("SshLaunchTest.AWrongKeyAnUnknownHostOrAnotherVersionIsRefusedNamingTheSite"
  PROPERTIES RUN_SERIAL TRUE)
