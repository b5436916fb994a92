# Chapter 6 against chapter 1 on the same global batch: TP alone, DP x TP, a Qwen3, a Qwen2 (from
# a folder with trained biases) and a Mistral under TP, resume, bad input.
foreach(check tp-parity dp-tp-parity qwen3-tp-parity qwen2-tp-parity mistral-tp-parity resume bad-input)
  add_test(NAME "examples: 06-tensor-parallel ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter06_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:06-tensor-parallel> ${check}
                   $<TARGET_FILE:meshtorch-consolidate>)
  set_tests_properties("examples: 06-tensor-parallel ${check}" PROPERTIES LABELS "examples;multiprocess" TIMEOUT 300)
endforeach()
