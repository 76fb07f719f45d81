# ROS 2 wheels from PyPI were built in a manylinux container: their exported
# *__rosidl_generator_py targets list include directories under /opt/python/..., which do not
# exist on the machine that builds this package. Drop those entries and add this
# interpreter's Python and NumPy include directories instead. On a normal ROS install no
# entry starts with /opt/python/ and this is a no-op.
function(vla_fix_pypi_rosidl_include_dirs)
  find_package(Python3 REQUIRED COMPONENTS Interpreter Development NumPy)
  get_property(_targets DIRECTORY PROPERTY IMPORTED_TARGETS)
  foreach(_t IN LISTS _targets)
    if(_t MATCHES "__rosidl_generator_py$")
      get_target_property(_inc ${_t} INTERFACE_INCLUDE_DIRECTORIES)
      if(_inc)
        set(_kept "")
        set(_dropped FALSE)
        foreach(_d IN LISTS _inc)
          if(_d MATCHES "^/opt/python/")
            set(_dropped TRUE)
          else()
            list(APPEND _kept "${_d}")
          endif()
        endforeach()
        if(_dropped)
          list(APPEND _kept ${Python3_INCLUDE_DIRS} ${Python3_NumPy_INCLUDE_DIRS})
          set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_kept}")
        endif()
      endif()
    endif()
  endforeach()
endfunction()
