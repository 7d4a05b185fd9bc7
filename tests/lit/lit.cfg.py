# lit configuration of the hybrid compiler tests.
import os

import lit.formats

config.name = "hybrid"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir", ".test"]
config.excludes = ["Inputs", "CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = config.hybrid_lit_obj_root

# Our tools first, then FileCheck / not / count from LLVM.
config.environment["PATH"] = os.pathsep.join(
    [config.hybrid_tools_dir, config.llvm_tools_dir, config.environment.get("PATH", "")])
config.environment["FILECHECK_OPTS"] = "--enable-var-scope"

config.substitutions.append(("%data", os.path.join(config.hybrid_source_dir, "tests", "data")))
config.substitutions.append(("%python", config.python_executable))
config.substitutions.append(("%inputs", os.path.join(config.test_source_root, "Import", "Inputs")))
# hybrid-bench is built only with CUDA.
if os.path.exists(os.path.join(config.hybrid_tools_dir, "hybrid-bench")):
    config.available_features.add("hybrid-bench")
