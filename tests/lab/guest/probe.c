// SPDX-License-Identifier: GPL-2.0-or-later
/* qcommit lab probe: runs as the guest's workload (statically linked, started by /init).
 *
 *   probe DEV FILL_MIB INTERVAL_MS
 *
 * 1. Writes FILL_MIB MiB of data from offset 0 of DEV with 1 MiB O_DIRECT writes, then fsyncs.
 * 2. Every INTERVAL_MS does one 4 KiB O_DIRECT|O_DSYNC write (into the last 64 MiB of DEV, away
 *    from the fill) and prints one line per write on stdout (the serial console):
 *        P <seq> <completion_ms> <latency_us>
 *    completion_ms is CLOCK_MONOTONIC of the guest. Writes never overlap: a write that outlasts the
 *    interval delays the next one (no catch-up burst).
 * Marker lines: "LAB FILL <mib>", "LAB FILLED <ms>", "LAB PROBING <interval_ms>", "LAB ERROR ...".
 *
 *   probe DEV FILL_MIB INTERVAL_MS WRITER_KIBPS READ_PROBE
 *
 * A busy guest, beside the probe (each in its own process, from the end of the fill on):
 * - WRITER_KIBPS > 0: a database-like writer. 256 KiB O_DIRECT writes paced to WRITER_KIBPS KiB/s
 *   (no catch-up burst after a slow write) over the WRITER_AREA after the fill, an fdatasync
 *   after every MiB, one line per MiB: "W <seq> <completion_ms> <fdatasync_us> <mib_us>" (mib_us:
 *   the MiB's writes and its fdatasync, which is what the writer's own pacing waits for).
 * - READ_PROBE = 1: every INTERVAL_MS one 4 KiB O_DIRECT read of the filled data (spread over it,
 *   never the same block twice in a row): "R <seq> <completion_ms> <latency_us>". Reads queue
 *   behind the copy's writes too.
 *
 *   probe pattern DEV
 *
 * Known patterns at known offsets for merge tests (tests/lab/boot_verify.py regenerates them).
 * Prints "LAB SUM <crc32>" of the pattern region [0, PAT_REGION) as read back from DEV, then
 * reads commands from stdin, one per line:
 *   W <phase>  write phase <phase>'s blocks (O_DIRECT), fsync, read the region back and print
 *              "LAB WROTE <phase> <crc32>"
 *   V          print "LAB SUM <crc32>" again
 * Phase 0 writes all PAT_BLOCKS blocks of PAT_BLOCK bytes at i * PAT_BLOCK; phase p >= 1 writes
 * block i when (i + p) % (p + 1) == 0, at i * PAT_BLOCK + p * 4 KiB (straddling two clusters).
 * Block contents: byte k = k * 131 + i * 7 + p * 29 + 1, then the first 16 bytes replaced by
 * "QCLB", p (u32 LE), i (u64 LE). CRC-32 as zlib's crc32().
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024LL * 1024LL)
#define PROBE_BYTES 4096
#define PROBE_AREA (64 * MIB)
#define PROBE_SLOTS 4096 /* rotate over 16 MiB of the probe area */
#define WRITER_AREA (256 * MIB)
#define WRITER_BLOCK (256 * 1024)
#define WRITER_SYNC_EVERY (1 * MIB)

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n > 0) {
    ssize_t ignored = write(1, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
    (void)ignored;
  }
}

#define PAT_BLOCK (64 * 1024)
#define PAT_BLOCKS 512
#define PAT_REGION (PAT_BLOCKS * PAT_BLOCK + MIB)

static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n) {
  static uint32_t table[256];
  if (!table[1]) {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table[i] = c;
    }
  }
  crc = ~crc;
  while (n--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

static int region_crc(int fd, char *buf, uint32_t *out) {
  uint32_t crc = 0;
  for (off_t off = 0; off < PAT_REGION; off += MIB) {
    if (pread(fd, buf, MIB, off) != MIB) return -1;
    crc = crc32_update(crc, (const unsigned char *)buf, MIB);
  }
  *out = crc;
  return 0;
}

static int pattern_main(const char *dev) {
  int fd = open(dev, O_RDWR | O_DIRECT);
  char *buf = NULL;
  if (fd < 0 || posix_memalign((void **)&buf, 4096, MIB) != 0) {
    say("LAB ERROR open %s: %s\n", dev, strerror(errno));
    return 1;
  }
  uint32_t crc;
  if (region_crc(fd, buf, &crc) != 0) {
    say("LAB ERROR read %s: %s\n", dev, strerror(errno));
    return 1;
  }
  say("LAB SUM %08x\n", crc);
  char line[64];
  while (fgets(line, sizeof line, stdin)) {
    unsigned phase;
    if (line[0] == 'V') {
      if (region_crc(fd, buf, &crc) != 0) say("LAB ERROR read: %s\n", strerror(errno));
      else say("LAB SUM %08x\n", crc);
    } else if (sscanf(line, "W %u", &phase) == 1) {
      for (uint64_t i = 0; i < PAT_BLOCKS; i++) {
        if (phase > 0 && (i + phase) % (phase + 1) != 0) continue;
        for (int k = 0; k < PAT_BLOCK; k++) buf[k] = (char)(k * 131 + (int)i * 7 + (int)phase * 29 + 1);
        memcpy(buf, "QCLB", 4);
        uint32_t p32 = phase;
        memcpy(buf + 4, &p32, 4);
        memcpy(buf + 8, &i, 8);
        off_t off = (off_t)(i * PAT_BLOCK + phase * 4096u);
        if (pwrite(fd, buf, PAT_BLOCK, off) != PAT_BLOCK) {
          say("LAB ERROR pattern write at %lld: %s\n", (long long)off, strerror(errno));
          return 1;
        }
      }
      if (fsync(fd) != 0 || region_crc(fd, buf, &crc) != 0) {
        say("LAB ERROR fsync/read back: %s\n", strerror(errno));
        return 1;
      }
      say("LAB WROTE %u %08x\n", phase, crc);
    }
  }
  return 0;
}

static void sleep_until(int64_t t) {
  struct timespec ts = {(time_t)(t / 1000000000LL), (long)(t % 1000000000LL)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* The busy writer (see the head of this file): never returns. */
static void writer_main(const char *dev, off_t area, long long kibps) {
  int fd = open(dev, O_RDWR | O_DIRECT);
  char *buf = NULL;
  if (fd < 0 || posix_memalign((void **)&buf, 4096, WRITER_BLOCK) != 0) {
    say("LAB ERROR writer open %s: %s\n", dev, strerror(errno));
    _exit(1);
  }
  for (int i = 0; i < WRITER_BLOCK; i++) buf[i] = (char)(i * 17 + 3);
  const int64_t block_ns = (int64_t)WRITER_BLOCK * 1000000000LL / (kibps * 1024LL);
  const long long blocks_per_sync = WRITER_SYNC_EVERY / WRITER_BLOCK;
  say("LAB WRITER %lld\n", kibps);
  int64_t next = now_ns();
  for (unsigned long long mib = 0;; mib++) {
    int64_t start = now_ns();
    for (long long b = 0; b < blocks_per_sync; b++) {
      unsigned long long n = mib * (unsigned long long)blocks_per_sync + (unsigned long long)b;
      memcpy(buf, &n, sizeof n);
      off_t off = area + (off_t)((n * WRITER_BLOCK) % WRITER_AREA);
      if (pwrite(fd, buf, WRITER_BLOCK, off) != WRITER_BLOCK) say("LAB ERROR writer write: %s\n", strerror(errno));
      next += block_ns;
      int64_t now = now_ns();
      if (next < now) next = now;
      if (b + 1 < blocks_per_sync) sleep_until(next);
    }
    int64_t sync_start = now_ns();
    if (fdatasync(fd) != 0) say("LAB ERROR writer fdatasync: %s\n", strerror(errno));
    int64_t end = now_ns();
    say("W %llu %.3f %lld %lld\n", mib, (double)end / 1e6, (long long)((end - sync_start) / 1000),
        (long long)((end - start) / 1000));
    if (next < end) next = end;
    sleep_until(next);
  }
}

/* The read probe (see the head of this file): never returns. */
static void reader_main(const char *dev, long long fill_mib, long long interval_ms) {
  int fd = open(dev, O_RDONLY | O_DIRECT);
  char *buf = NULL;
  if (fd < 0 || posix_memalign((void **)&buf, 4096, PROBE_BYTES) != 0) {
    say("LAB ERROR reader open %s: %s\n", dev, strerror(errno));
    _exit(1);
  }
  const unsigned long long blocks = (unsigned long long)(fill_mib * MIB / PROBE_BYTES);
  say("LAB READING %lld\n", interval_ms);
  int64_t next = now_ns();
  for (unsigned long long seq = 0;; seq++) {
    /* A stride prime to the block count: every block once before any twice, none cached. */
    off_t off = (off_t)(((seq * 2654435761ULL) % blocks) * PROBE_BYTES);
    int64_t start = now_ns();
    ssize_t n = pread(fd, buf, PROBE_BYTES, off);
    int64_t end = now_ns();
    if (n != PROBE_BYTES) say("LAB ERROR read probe: %s\n", n < 0 ? strerror(errno) : "short");
    say("R %llu %.3f %lld\n", seq, (double)end / 1e6, (long long)((end - start) / 1000));
    next += interval_ms * 1000000LL;
    if (next < end) next = end;
    sleep_until(next);
  }
}

/* Starts the busy guest's writer and read probe (each a child process) as asked. */
static int start_busy(const char *dev, long long fill_mib, long long interval_ms, long long writer_kibps,
                      int read_probe) {
  if (writer_kibps > 0) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) writer_main(dev, (off_t)(fill_mib * MIB), writer_kibps);
  }
  if (read_probe && fill_mib > 0) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) reader_main(dev, fill_mib, interval_ms);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "pattern") == 0) return pattern_main(argv[2]);
  if (argc != 4 && argc != 6) {
    say("LAB ERROR usage: probe DEV FILL_MIB INTERVAL_MS [WRITER_KIBPS READ_PROBE]\n");
    return 2;
  }
  const char *dev = argv[1];
  long long fill_mib = atoll(argv[2]);
  long long interval_ms = atoll(argv[3]);
  long long writer_kibps = argc == 6 ? atoll(argv[4]) : 0;
  int read_probe = argc == 6 && atoi(argv[5]) == 1;
  if (interval_ms <= 0) interval_ms = 100;

  int fd = open(dev, O_RDWR | O_DIRECT);
  if (fd < 0) {
    say("LAB ERROR open %s: %s\n", dev, strerror(errno));
    return 1;
  }
  unsigned long long dev_bytes = 0;
  unsigned long long writer_bytes = writer_kibps > 0 ? (unsigned long long)WRITER_AREA : 0;
  if (ioctl(fd, BLKGETSIZE64, &dev_bytes) < 0 ||
      dev_bytes < (unsigned long long)(fill_mib * MIB + 2 * PROBE_AREA) + writer_bytes) {
    say("LAB ERROR %s: %llu bytes is too small for fill %lld MiB\n", dev, dev_bytes, fill_mib);
    return 1;
  }

  char *buf = NULL;
  if (posix_memalign((void **)&buf, 4096, MIB) != 0) {
    say("LAB ERROR out of memory\n");
    return 1;
  }
  for (long long i = 0; i < MIB; i++) buf[i] = (char)(i * 131 + 7);

  say("LAB FILL %lld\n", fill_mib);
  int64_t t0 = now_ns();
  for (long long m = 0; m < fill_mib; m++) {
    memcpy(buf, &m, sizeof m); /* make every MiB distinct */
    if (pwrite(fd, buf, MIB, m * MIB) != MIB) {
      say("LAB ERROR fill write at %lld MiB: %s\n", m, strerror(errno));
      return 1;
    }
    if (m % 256 == 255) say("LAB FILL-PROGRESS %lld\n", m + 1);
  }
  if (fsync(fd) < 0) {
    say("LAB ERROR fsync: %s\n", strerror(errno));
    return 1;
  }
  say("LAB FILLED %lld\n", (long long)((now_ns() - t0) / 1000000));
  close(fd);

  fd = open(dev, O_RDWR | O_DIRECT | O_DSYNC);
  if (fd < 0) {
    say("LAB ERROR open %s: %s\n", dev, strerror(errno));
    return 1;
  }
  off_t area = (off_t)(dev_bytes - PROBE_AREA);
  if (start_busy(dev, fill_mib, interval_ms, writer_kibps, read_probe) != 0) {
    say("LAB ERROR fork: %s\n", strerror(errno));
    return 1;
  }
  say("LAB PROBING %lld\n", interval_ms);
  int64_t next = now_ns();
  for (unsigned long long seq = 0;; seq++) {
    memcpy(buf, &seq, sizeof seq);
    off_t off = area + (off_t)(seq % PROBE_SLOTS) * PROBE_BYTES;
    int64_t start = now_ns();
    ssize_t n = pwrite(fd, buf, PROBE_BYTES, off);
    int64_t end = now_ns();
    if (n != PROBE_BYTES) say("LAB ERROR probe write: %s\n", n < 0 ? strerror(errno) : "short");
    say("P %llu %.3f %lld\n", seq, (double)end / 1e6, (long long)((end - start) / 1000));
    next += interval_ms * 1000000LL;
    if (next < end) next = end;
    sleep_until(next);
  }
}
