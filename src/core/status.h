// Status helpers of the core: every error message of the library has the form
//   msa::<entry>: argument '<name>': <what was expected>, got <what was passed>
// and is built here, so the API's validation and the backends' own limits read alike.
#pragma once

#include <string>

#include "msa/types.h"

// Returns the Status of `expr` from the enclosing function unless it is ok.
#define MSA_TRY(expr)          \
  do {                         \
    Status _s = (expr);        \
    if (!_s.ok()) return _s;   \
  } while (0)

namespace msa::detail {

inline std::string arg_message(const char* fn, const char* arg, const std::string& what) {
  return std::string("msa::") + fn + ": argument '" + arg + "': " + what;
}

// Bad input: the message names the argument.
inline Status invalid_arg(const char* fn, const char* arg, const std::string& what) {
  return Status::Invalid(arg_message(fn, arg, what));
}

// Valid input that a backend does not implement: the message names the argument and the limit.
inline Status unsupported_arg(const char* fn, const char* arg, const std::string& what) {
  return Status::NotSupported(arg_message(fn, arg, what));
}

}  // namespace msa::detail
