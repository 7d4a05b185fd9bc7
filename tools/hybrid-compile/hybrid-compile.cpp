// hybrid-compile: Hugging Face checkpoint directory -> hybrid IR (and, later, plan + weights).
#include "compiler/Analysis/ModelSummary.h"
#include "compiler/Import/Importer.h"
#include "dialects/Hybrid/IR/HybridDialect.h"

#include "mlir/IR/MLIRContext.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/ToolOutputFile.h"
#include "mlir/Support/FileUtilities.h"

namespace cl = llvm::cl;

namespace {
enum class Emit { Mlir, Summary };

cl::opt<std::string> modelDir(cl::Positional, cl::desc("<model dir>"), cl::Required);
cl::opt<Emit> emit("emit", cl::desc("What to produce"),
                   cl::values(clEnumValN(Emit::Mlir, "mlir", "the imported hybrid IR"),
                              clEnumValN(Emit::Summary, "summary",
                                         "layers, parameters, cache and state sizes")),
                   cl::init(Emit::Mlir));
cl::opt<std::string> outputPath("o", cl::desc("Output file (default: stdout)"),
                                cl::value_desc("file"), cl::init("-"));
cl::opt<std::string> mappingPath("mapping",
                                 cl::desc("Architecture mapping JSON to use instead of the "
                                          "built-in one for the config's model_type"),
                                 cl::value_desc("file"), cl::init(""));
} // namespace

int main(int argc, char **argv) {
  llvm::InitLLVM initLLVM(argc, argv);
  cl::ParseCommandLineOptions(argc, argv, "hybrid ahead-of-time compiler\n");

  mlir::MLIRContext context;
  context.getOrLoadDialect<hybrid::HybridDialect>();
  hybrid::import::ImportOptions options;
  options.mappingPath = mappingPath;
  auto module = hybrid::import::importCheckpoint(context, modelDir, options);
  if (!module) {
    llvm::errs() << "error: " << module.status().message() << "\n";
    return 1;
  }

  std::string error;
  auto output = mlir::openOutputFile(outputPath, &error);
  if (!output) {
    llvm::errs() << "error: " << error << "\n";
    return 1;
  }
  if (emit == Emit::Summary) {
    for (auto model : (*module)->getOps<hybrid::ModelOp>())
      hybrid::analysis::printModelSummary(model, output->os());
  } else {
    (*module)->print(output->os());
    output->os() << "\n";
  }
  output->keep();
  return 0;
}
