# Chapter 11 (pipeline parallel, with FSDP and TP inside the stages and DP replicas) against
# chapter 1 on the same global batch, resume across meshes, a stalled stage, and schedules refused
# at start-up.
foreach(check 1f1b-parity schedules-parity fsdp-pp-parity pp-tp-parity qwen3-pp-tp-parity qwen2-pp-tp-parity resume-across-meshes
              stalled-stage bad-flags)
  add_test(NAME "examples: 11-pipeline-parallel ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter11_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:07-2d-parallel>
                   $<TARGET_FILE:11-pipeline-parallel> ${check})
  set_tests_properties("examples: 11-pipeline-parallel ${check}" PROPERTIES LABELS "examples;multiprocess" TIMEOUT 300)
endforeach()
