// SPDX-License-Identifier: GPL-2.0-or-later
// The descriptor owner lives in common/ (every layer uses it); this name is kept for the qcow2
// library's own sources.
#pragma once

#include "common/unique_fd.h"
