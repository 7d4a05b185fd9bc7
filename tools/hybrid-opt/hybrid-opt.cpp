// hybrid-opt: mlir-opt with the hybrid dialects and passes only (registering every upstream
// dialect would cost minutes of build time and nothing here uses them).
#include "compiler/Transforms/Passes.h"
#include "dialects/Hybrid/IR/HybridDialect.h"
#include "dialects/Plan/IR/PlanDialect.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<hybrid::HybridDialect, hybrid::plan::PlanDialect, mlir::func::FuncDialect,
                  mlir::arith::ArithDialect>();
  hybrid::registerHybridPasses();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "hybrid optimizer driver\n", registry));
}
