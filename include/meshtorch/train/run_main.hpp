#pragma once
// A chapter's `main`: its flags parsed, then its training inside run_recorded (the launcher's
// error file gets any exception), as every chapter's main did by hand:
//
//   int main(int argc, char** argv) { return mt::train::run_main<Chapter6Args>(argc, argv, train); }
//
// with the program's one-line description (--help's first line) in Chapter6Args::description.
#include <string>
#include <utility>

#include <meshtorch/diagnostics/error_file.hpp>
#include <meshtorch/train/args.hpp>

namespace meshtorch::train {

// `Args`: TrainArgs with the chapter's own flags, added by its add_to(CLI::App&). --help and a
// bad flag end the program as CLI11 says; otherwise it returns what `body(args)` returns.
template <class Args, class Body>
int run_main(int argc, char** argv, const std::string& description, Body&& body) {
  CLI::App app{description};
  Args args;
  args.add_to(app);
  CLI11_PARSE(app, argc, argv);
  return diagnostics::run_recorded([&] { return body(std::as_const(args)); });
}

template <class Args, class Body>
int run_main(int argc, char** argv, Body&& body) {
  return run_main<Args>(argc, argv, Args::description, std::forward<Body>(body));
}

}  // namespace meshtorch::train
