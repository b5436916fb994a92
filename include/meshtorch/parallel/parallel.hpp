#pragma once
// Module wrappers that join models to meshes: one header per technique.
#include <meshtorch/parallel/checkpoint.hpp>
#include <meshtorch/parallel/ddp.hpp>
#include <meshtorch/parallel/fsdp.hpp>
#include <meshtorch/parallel/process_group.hpp>
#include <meshtorch/parallel/rank.hpp>
#include <meshtorch/parallel/zero.hpp>
