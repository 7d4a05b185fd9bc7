// hybrid-opt: mlir-opt with the hybrid dialects and passes only (registering every upstream
// dialect would cost minutes of build time and nothing here uses them).
#include "dialects/Hybrid/IR/HybridDialect.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<hybrid::HybridDialect, mlir::func::FuncDialect, mlir::arith::ArithDialect>();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "hybrid optimizer driver\n", registry));
}
