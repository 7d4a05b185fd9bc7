#ifndef PLAN_BASE_TD
#define PLAN_BASE_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"

def Plan_Dialect : Dialect {
  let name = "plan";
  let cppNamespace = "::hybrid::plan";
  let summary = "The execution plan, one to one with runtime/schema/plan.fbs";
  let description = [{
    Mirrors the FlatBuffers schema the runtime loads: weights (by archive offset), cache specs,
    and programs made of values (arena slots) and steps (kernel dispatches with stream and event
    ids, copies). Lowering `hybrid` to `plan` makes every execution decision explicit; writing
    the plan file is then a walk over this IR, checked first by `--plan-verify-contract`.
  }];
  let useDefaultAttributePrinterParser = 1;
}

class Plan_Op<string mnemonic, list<Trait> traits = []> : Op<Plan_Dialect, mnemonic, traits>;

#endif // PLAN_BASE_TD
