# Chapter 12 (context parallel in the five-axis mesh) against chapter 1 on the same global batch:
# each --cp-rotate method on 2 and 4 ranks, CP x TP (also on Qwen3 and Qwen2 folders), FSDP x CP and DP x CP, with activation
# checkpointing, the chunked loss and micro-batches; PP x CP (x TP, x FSDP); resume across meshes;
# sequence lengths that do not split refused at start-up.
foreach(check cp2-parity cp4-parity cp-tp-parity families-cp-parity fsdp-cp-parity composition-parity pp-cp-parity resume-across-meshes
        bad-flags)
  add_test(NAME "examples: 12-context-parallel ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter12_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:07-2d-parallel>
                   $<TARGET_FILE:12-context-parallel> ${check})
  set_tests_properties("examples: 12-context-parallel ${check}" PROPERTIES LABELS "examples;multiprocess" TIMEOUT 300)
endforeach()
