# Included by every directory that builds against MLIR (dialects, compiler, MLIR tools, lit tests).
# find_package(MLIR) and HandleLLVMOptions stay out of the top level so LLVM's flags
# (-fno-exceptions and friends) never reach the runtime, kernel or CUDA targets.
find_package(MLIR 19.1 REQUIRED CONFIG HINTS /usr/lib/llvm-19/lib/cmake/mlir)
list(APPEND CMAKE_MODULE_PATH "${MLIR_CMAKE_DIR}" "${LLVM_CMAKE_DIR}")
include(TableGen)
include(AddLLVM)
include(AddMLIR)
include(HandleLLVMOptions)
include_directories(SYSTEM ${LLVM_INCLUDE_DIRS} ${MLIR_INCLUDE_DIRS})
include_directories(${HYBRID_SOURCE_DIR} ${HYBRID_BINARY_DIR} ${HYBRID_SOURCE_DIR}/runtime/include)
link_directories(${LLVM_BUILD_LIBRARY_DIR})
add_definitions(${LLVM_DEFINITIONS})

# Under HYBRID_ENABLE_ASAN, code built against MLIR stays uninstrumented: LLVM's headers poison
# allocator memory only when instrumented, so mixing them with Debian's uninstrumented MLIR
# libraries reports false use-after-poison errors. The libraries that parse untrusted bytes
# (safetensors, plan, weight archive, cache) are instrumented and linked into these tools.
if(HYBRID_ENABLE_ASAN)
  get_directory_property(hybrid_compile_options COMPILE_OPTIONS)
  list(FILTER hybrid_compile_options EXCLUDE REGEX "sanitize")
  set_directory_properties(PROPERTIES COMPILE_OPTIONS "${hybrid_compile_options}")
endif()
