# Chapter 7 (FSDP x TP, HSDP, 3D) against chapter 1 on the same global batch, and resume; its
# evaluation, and generation from its sharded checkpoint.
foreach(check fsdp-tp-parity reshard-parity hsdp-parity 3d-parity resume reshard-resume eval-generate)
  add_test(NAME "examples: 07-2d-parallel ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter07_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:07-2d-parallel> ${check}
                   $<TARGET_FILE:meshtorch-consolidate> $<TARGET_FILE:meshtorch-eval-loss>
                   $<TARGET_FILE:meshtorch-generate>)
  set_tests_properties("examples: 07-2d-parallel ${check}" PROPERTIES LABELS "examples;multiprocess" TIMEOUT 300)
endforeach()
