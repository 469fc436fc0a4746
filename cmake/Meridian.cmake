# Small helpers shared by every folder.

# Warnings used by all Meridian targets.
function(meridian_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers>)
endfunction()

# meridian_add_library(NAME SOURCES... [DEPS ...] [PRIVATE_DEPS ...])
# Defines meridian_NAME with alias meridian::NAME; includes are rooted at the repository root.
function(meridian_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(meridian_${name} STATIC ${ARG_SOURCES})
  add_library(meridian::${name} ALIAS meridian_${name})
  target_include_directories(meridian_${name} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(meridian_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  meridian_warnings(meridian_${name})
endfunction()

# meridian_add_test(NAME LABEL SOURCES... DEPS ...)
# One GoogleTest binary; each TEST is a ctest case carrying LABEL (unit or integration).
function(meridian_add_test name label)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  meridian_warnings(${name})
  # Tests find the sources and the built binaries through these (overridable by the environment
  # variables of the same names).
  target_compile_definitions(${name} PRIVATE
    MERIDIAN_TEST_SOURCE_DIR="${PROJECT_SOURCE_DIR}" MERIDIAN_TEST_BINARY_DIR="${PROJECT_BINARY_DIR}")
  gtest_discover_tests(${name}
    PROPERTIES LABELS ${label} TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()

# meridian_add_fuzzer(NAME SOURCE DEPS ...): a libFuzzer target (clang, ASan + UBSan), built only with
# -DMERIDIAN_FUZZ=ON; scripts/fuzz.sh builds and runs them for a bounded time.
function(meridian_add_fuzzer name source)
  if(NOT MERIDIAN_FUZZ)
    return()
  endif()
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARGN})
  target_compile_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
endfunction()
