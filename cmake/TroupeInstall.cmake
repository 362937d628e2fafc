# Installs headers and exported targets so that another CMake project can
# find_package(troupe) and link troupe::runtime (and the other layers).
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/runtime ${PROJECT_SOURCE_DIR}/actors ${PROJECT_SOURCE_DIR}/trainer
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/troupe
  FILES_MATCHING PATTERN "*.h")
# Users include <troupe/troupe.h>, <troupe/trainer.h> and the layer headers
# as <troupe/runtime/...>: the include directory exported is include/.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/troupe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/include/troupe/config.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/troupe)
install(FILES ${TROUPE_GENERATED_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/troupe/runtime/wire OPTIONAL)

get_property(_troupe_targets GLOBAL PROPERTY TROUPE_EXPORTED_TARGETS)
install(TARGETS troupe_asio troupe_runtime ${_troupe_targets}
  EXPORT troupeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT troupeTargets NAMESPACE troupe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/troupe)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/troupeConfig.cmake.in
  ${PROJECT_BINARY_DIR}/troupeConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/troupe)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/troupeConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/troupeConfig.cmake ${PROJECT_BINARY_DIR}/troupeConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/troupe)
