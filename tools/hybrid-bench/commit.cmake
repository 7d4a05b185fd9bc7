# Writes OUT (a header defining HYBRID_BENCH_COMMIT) with the source tree's current commit, only
# when it changed, so a benchmark record never names a stale commit and nothing rebuilds for
# nothing. Run at build time by the hybrid_bench_commit target.
execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY ${SOURCE_DIR}
  OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY ${SOURCE_DIR}
  OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NOT commit)
  set(commit "unknown")
elseif(changes)
  set(commit "${commit}+changes")
endif()
file(WRITE ${OUT}.tmp "#define HYBRID_BENCH_COMMIT \"${commit}\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.tmp ${OUT})
