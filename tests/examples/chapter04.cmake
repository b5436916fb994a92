# Chapter 4 against chapter 1 on the same global batch (fsdp, without resharding and with CPU
# offload, with gradient accumulation), resume from a sharded checkpoint, the consolidated
# export loading into chapter 1, and bf16 compute.
foreach(check fsdp-parity no-reshard-offload-parity grad-accum-parity qwen3-fsdp-parity qwen2-fsdp-parity mistral-fsdp-parity resume export bf16)
  add_test(NAME "examples: 04-fully-sharded-data-parallel ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter04_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:04-fully-sharded-data-parallel> ${check})
  set_tests_properties("examples: 04-fully-sharded-data-parallel ${check}" PROPERTIES LABELS "examples;multiprocess"
                       TIMEOUT 300)
endforeach()
