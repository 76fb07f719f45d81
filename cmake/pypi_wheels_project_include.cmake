# For a third-party rosidl package built unmodified over the PyPI wheels (the Makefile builds
# ../shared/ros2-jazzy/src/composition_interfaces with
# -DCMAKE_PROJECT_INCLUDE=<this file>): CMake includes it right after the package's project(),
# and the include-directory fix of pypi_wheels.cmake is deferred to the end of the package's
# CMakeLists.txt, after rosidl_generate_interfaces() imported the targets it repairs.
include("${CMAKE_CURRENT_LIST_DIR}/pypi_wheels.cmake")
cmake_language(DEFER CALL vla_fix_pypi_rosidl_include_dirs)
