// Precompiled-header carrier: see meshtorchBuildHelpers.cmake.
