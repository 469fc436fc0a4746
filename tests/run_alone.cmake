# Included by ctest after the discovered tests (TEST_INCLUDE_FILES, tests/CMakeLists.txt).
# A test whose pass/fail figure is a wall-clock latency that an issue names runs alone, never beside a
# training run on the same cores: #23's "a wrong key, an unknown host or another version is refused in
# under 10 s" took 4.4 s here beside two busy loops, and failed in a clean-clone CI run beside a
# three-executor training test. (Every other timing is recorded, never asserted.)
set_tests_properties("SshLaunchTest.AWrongKeyAnUnknownHostOrAnotherVersionIsRefusedNamingTheSite"
  PROPERTIES RUN_SERIAL TRUE)
# #21's CPU-quota straggler: the slowed site must stand out from the others' times, which a training
# test beside it on the same two cores would move.
set_tests_properties("CoordinatorTest.AStageSlowedByACpuQuotaIsReplannedAroundWithNoStepLost"
  PROPERTIES RUN_SERIAL TRUE)
