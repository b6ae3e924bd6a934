// SPDX-License-Identifier: GPL-2.0-or-later
// LD_PRELOAD shim for libvirt.live_pivot_not_ready: the first QCOMMIT_TEST_PIVOT_REFUSALS (default
// 1) pivots are refused the way libvirt refuses one while it has not yet taken in QEMU's ready
// event although the job's figures already say ready: virDomainBlockJobAbort(..., PIVOT) fails
// with VIR_ERR_BLOCK_COPY_ACTIVE as the thread's last error. Later pivots go through to libvirt.
// Each refusal appends "refused DISK" to the file QCOMMIT_TEST_PIVOT_LOG names.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*BlockJobAbort)(virDomainPtr, const char*, unsigned int);
// libvirt's own setter of the thread's last error: exported, but not in its public headers (and
// versioned as private), so looked up at run time rather than linked against.
typedef int (*SetError)(virErrorPtr);

static int refused;

int virDomainBlockJobAbort(virDomainPtr dom, const char* disk, unsigned int flags) {
  const BlockJobAbort real = (BlockJobAbort)dlsym(RTLD_NEXT, "virDomainBlockJobAbort");
  const char* n = getenv("QCOMMIT_TEST_PIVOT_REFUSALS");
  const int refusals = n ? atoi(n) : 1;
  if (!(flags & VIR_DOMAIN_BLOCK_JOB_ABORT_PIVOT) || refused >= refusals)
    return real ? real(dom, disk, flags) : -1;
  ++refused;
  virError e;
  memset(&e, 0, sizeof e);
  e.code = VIR_ERR_BLOCK_COPY_ACTIVE;
  e.domain = VIR_FROM_QEMU;
  e.level = VIR_ERR_ERROR;
  e.message = (char*)"block copy still active: disk not ready for pivot yet (test shim)";
  const SetError set_error = (SetError)dlsym(RTLD_DEFAULT, "virSetError");
  if (!set_error) {
    fprintf(stderr, "pivot_refusal_shim: libvirt has no virSetError\n");
    abort();
  }
  set_error(&e);
  const char* log = getenv("QCOMMIT_TEST_PIVOT_LOG");
  FILE* f = log ? fopen(log, "a") : NULL;
  if (f) {
    fprintf(f, "refused %s\n", disk);
    fclose(f);
  }
  return -1;
}
