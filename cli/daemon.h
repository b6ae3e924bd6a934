// SPDX-License-Identifier: GPL-2.0-or-later
// qcommitd's control socket, client side: whether the daemon answers, and one request/response.
#pragma once

#include <optional>
#include <string>

namespace qcommit::cli {

[[nodiscard]] bool qcommitd_answers(const std::string& socket_path);

// One request line to qcommitd and its one response line (without the newline); nullopt with
// `error` set when the socket cannot be reached or the send fails.  Throws UsageError when the
// path cannot be a socket's.
[[nodiscard]] std::optional<std::string> ask_qcommitd(const std::string& socket_path,
                                                      const std::string& request,
                                                      std::string& error);

}  // namespace qcommit::cli
