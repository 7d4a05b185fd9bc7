# cmake -DSOURCE=CHECKPOINT -DOUT=DIR -DTOPK=N -P copy-with-index-topk.cmake: a copy of a
# DeepSeek-V3.2 checkpoint whose indexer selects N positions (config.json's index_topk), so a
# test can make the top-k larger than a KV cache's capacity without full-size weights.
foreach(var SOURCE OUT TOPK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "copy-with-index-topk.cmake: -D${var}= is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${OUT}")
file(COPY "${SOURCE}/" DESTINATION "${OUT}")
file(READ "${OUT}/config.json" config)
string(REGEX REPLACE "\"index_topk\": *[0-9]+" "\"index_topk\": ${TOPK}" edited "${config}")
if(edited STREQUAL config)
  message(FATAL_ERROR "${SOURCE}/config.json: no index_topk to replace")
endif()
file(WRITE "${OUT}/config.json" "${edited}")
