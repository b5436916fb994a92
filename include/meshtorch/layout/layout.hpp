#pragma once
// The compile-time layout core: axes, meshes, placements, redistribution rules and parallel
// styles. No LibTorch, no fmt (its formatters are in format.hpp).
#include <meshtorch/layout/axis.hpp>
#include <meshtorch/layout/extent.hpp>
#include <meshtorch/layout/mesh.hpp>
#include <meshtorch/layout/mesh_shape.hpp>
#include <meshtorch/layout/parallel_style.hpp>
#include <meshtorch/layout/pipeline_schedule.hpp>
#include <meshtorch/layout/pipeline_split.hpp>
#include <meshtorch/layout/placement.hpp>
#include <meshtorch/layout/redistribution.hpp>
