#pragma once
// The run-time communication layer: launch environment, mesh init, collectives,
// redistribution and differentiable collectives, the flight recorder and the watchdog.
#include <meshtorch/comm/axis_group.hpp>
#include <meshtorch/comm/backend.hpp>
#include <meshtorch/comm/collective_failure.hpp>
#include <meshtorch/comm/collectives.hpp>
#include <meshtorch/comm/device_mesh.hpp>
#include <meshtorch/comm/differentiable.hpp>
#include <meshtorch/comm/env.hpp>
#include <meshtorch/comm/fingerprint.hpp>
#include <meshtorch/comm/flight_recorder.hpp>
#include <meshtorch/comm/hang_analysis.hpp>
#include <meshtorch/comm/local_device.hpp>
#include <meshtorch/comm/redistribute.hpp>
#include <meshtorch/comm/rendezvous.hpp>
#include <meshtorch/comm/watchdog.hpp>
#include <meshtorch/comm/work.hpp>
