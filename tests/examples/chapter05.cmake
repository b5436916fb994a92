# Chapter 5: the recipe with everything on and off against chapter 1, and against itself without
# checkpointing and prefetch, and with its shards, gradients or AdamW offloaded or not; stop and resume; pretrained weights read by rank 0 or every rank;
# a 400 MB folder written by transformers loaded within half the folder plus its largest tensor
# (with the bench environment; skipped without it); launch.sh over a hosts file.
foreach(check recipe-parity optimizer-in-backward offload resume pretrained load-folder launch)
  add_test(NAME "examples: 05-training-llama-405b ${check}"
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_SOURCE_DIR}/chapter05_checks.py
                   $<TARGET_FILE:meshrun> $<TARGET_FILE:01-single-gpu> $<TARGET_FILE:05-training-llama-405b>
                   $<TARGET_FILE:meshtorch-consolidate> ${check} ${PROJECT_SOURCE_DIR}/bench/.venv/bin/python)
  set_tests_properties("examples: 05-training-llama-405b ${check}" PROPERTIES LABELS "examples;multiprocess"
                       TIMEOUT 300 SKIP_RETURN_CODE 77)
endforeach()
add_test(NAME "examples: 05-training-llama-405b bash -n launch.sh"
         COMMAND bash -n ${PROJECT_SOURCE_DIR}/examples/05-training-llama-405b/launch.sh)
set_tests_properties("examples: 05-training-llama-405b bash -n launch.sh" PROPERTIES LABELS examples)
