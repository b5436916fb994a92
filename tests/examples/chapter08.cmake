# Chapter 8: the DeepSpeed-style engine. ZeRO stages 0-3 against chapter 1 on the same global
# batch (plain, and with clipping and a warmup-cosine schedule), stages 1-3 with the optimizer
# offloaded against themselves without it, resume through the engine's
# checkpoints for every stage, and bad configs refused at start-up with their key path.
foreach(check stages-parity clipping-parity optimizer-offload resume config-errors)
  add_test(NAME "examples: 08-alternative-frameworks ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter08_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:08-alternative-frameworks> ${check})
  set_tests_properties("examples: 08-alternative-frameworks ${check}" PROPERTIES LABELS "examples;multiprocess"
                       TIMEOUT 300)
endforeach()
