#pragma once
// The run-time communication layer: launch environment, the device mesh and its groups,
// collectives, redistribution and differentiable collectives, the flight recorder.
// Start-up code also includes comm/init.hpp (comm::init: rendezvous, Gloo/NCCL groups, the
// watchdog); the watchdog and hang analysis are diagnostics/watchdog.hpp and diagnostics/hang_analysis.hpp.
#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/device.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/comm/differentiable.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/comm/point_to_point.hpp>
#include <meshtorch/comm/redistribute.hpp>
#include <meshtorch/comm/work.hpp>
#include <meshtorch/diagnostics/collective_failure.hpp>
#include <meshtorch/diagnostics/fingerprint.hpp>
#include <meshtorch/diagnostics/flight_recorder.hpp>
