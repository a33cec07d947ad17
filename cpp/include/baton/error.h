// Error types thrown by the Baton core. Every error carries a human-readable
// message that names the offending rank / instruction / stage / microbatch.
// The Python bindings map these onto baton.BatonError subclasses.
#pragma once
#include <stdexcept>
#include <string>

namespace baton {

// Base of every error Baton throws on user input or on a failed check.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A schedule generator refuses the requested combination, or a Schedule
// object is malformed (Python: baton.ScheduleError, a ValueError).
class ScheduleError : public Error {
 public:
  using Error::Error;
};

// The schedule text format or a cost JSON could not be parsed. The message
// starts with "line L, column C:" where applicable (Python: baton.FormatError,
// a ValueError).
class FormatError : public Error {
 public:
  FormatError(int line, int column, const std::string& what);
  explicit FormatError(const std::string& what) : Error(what) {}
  int line = 0;    // 1-based, 0 when not applicable
  int column = 0;  // 1-based, 0 when not applicable
};

// A lowered plan failed verification (Python: baton.VerifyError, a
// RuntimeError). The message is the full report.
class VerifyError : public Error {
 public:
  using Error::Error;
};

// Bad cost model / options (Python: baton.ConfigError, a ValueError).
class ConfigError : public Error {
 public:
  using Error::Error;
};

}  // namespace baton
