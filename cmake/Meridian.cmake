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

# meridian_link_closure(TARGET OUT): every library TARGET links, directly or through other targets
# (LINK_LIBRARIES and INTERFACE_LINK_LIBRARIES, recursively), one per line into OUT at configure time.
# Call it after every target is defined. Tests read it to check a layering rule (the coordinator links
# no torch).
function(_meridian_link_closure_visit item out_var seen_var)
  set(seen ${${seen_var}})
  set(out ${${out_var}})
  if(item IN_LIST seen)
    return()
  endif()
  list(APPEND seen ${item})
  list(APPEND out ${item})
  if(TARGET ${item})
    get_target_property(aliased ${item} ALIASED_TARGET)
    set(real ${item})
    if(aliased)
      set(real ${aliased})
    endif()
    get_target_property(type ${real} TYPE)
    set(deps "")
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${real} LINK_LIBRARIES)
      if(direct)
        list(APPEND deps ${direct})
      endif()
    endif()
    get_target_property(iface ${real} INTERFACE_LINK_LIBRARIES)
    if(iface)
      list(APPEND deps ${iface})
    endif()
    foreach(dep IN LISTS deps)
      string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" dep "${dep}")
      if(dep MATCHES "^\\$<")
        continue()
      endif()
      _meridian_link_closure_visit(${dep} out seen)
    endforeach()
  endif()
  set(${seen_var} ${seen} PARENT_SCOPE)
  set(${out_var} ${out} PARENT_SCOPE)
endfunction()

function(meridian_link_closure target out_file)
  set(out "")
  set(seen "")
  _meridian_link_closure_visit(${target} out seen)
  list(REMOVE_AT out 0)
  string(REPLACE ";" "\n" text "${out}")
  file(WRITE ${out_file} "${text}\n")
endfunction()
