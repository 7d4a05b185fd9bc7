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
