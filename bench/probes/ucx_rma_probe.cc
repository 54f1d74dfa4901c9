// ucx_rma_probe: can a process read another process's memory one-sided
// through UCX 1.13 on this machine (no RDMA hardware)? The question under
// issue 14 (ckpt-dpu-agent's pull-mode ingest). Not part of the build.
//
// Owner = parent: maps S bytes with ucp_mem_map (its own buffer, or with
// "alloc" memory UCX allocates), packs the rkey, hands worker address, rkey
// and address to the child through a pipe, progresses its worker until the
// child's 1-byte warm-up get is done (endpoint wire-up), then stops
// progressing (or not, with "progress") and measures its own CPU time while
// the child pulls. Puller = child: endpoint to the owner's worker (error
// mode "none" or "peer"), ucp_rkey_unpack, then ucp_rkey_ptr + memcpy if the
// rkey maps, and ucp_get_nbx of all S bytes, 3 rounds each, every byte checked.
//
//   g++ -O2 -std=c++20 bench/probes/ucx_rma_probe.cc -lucp -lucs -o /tmp/ucx_rma_probe
//   UCX_NET_DEVICES=lo UCX_TLS=posix,cma /tmp/ucx_rma_probe 67108864 none noprogress alloc
//
// Found (2026-11-27, UCX 1.13.1, Debian 12, 2-core VM, 64 MiB):
// - Memory the owner allocated itself (malloc'd, then ucp_mem_map'd): no
//   transport (tcp, cma, posix, sysv, sm) completes a get while the owner
//   does not progress: UCX 1.13 picks no "rma" lane here (cma has zcopy gets
//   but no bcopy/short ops, so it only serves rendezvous as rma_bw) and
//   ucp_get_nbx falls back to software RMA over active messages, which the
//   owner's CPU serves (about 180 ms of owner CPU per 64 MiB, 0.35-2 GB/s).
// - Memory UCX allocated (UCP_MEM_MAP_ALLOCATE) on the posix or sysv shared
//   memory md: ucp_rkey_ptr maps it in the puller, and ucp_get_nbx completes
//   with the owner idle: owner CPU 0.02 ms for 3 x 64 MiB, 4-5 GB/s (a
//   memcpy). One-sided.
// - Error mode "peer" (what ckpt's UcxTransport uses): shared-memory
//   transports have no peer-failure handler, so an endpoint over posix/cma
//   alone is "unreachable", and with tcp+posix the get does not complete
//   without owner progress. A pull endpoint must use error mode "none"
//   (liveness from the TCP side channel, as the transport already has) or
//   read through ucp_rkey_ptr. On RDMA hardware (rc/dc verbs) gets are
//   native RDMA READs in either mode.
#include <sys/resource.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void die(const char* what, ucs_status_t st) {
  std::fprintf(stderr, "%s: %s\n", what, ucs_status_string(st));
  std::exit(1);
}

static void setup(ucp_context_h* ctx, ucp_worker_h* w) {
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  ucp_config_t* cfg;
  ucp_config_read(nullptr, nullptr, &cfg);
  ucs_status_t st = ucp_init(&p, cfg, ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) die("ucp_init", st);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(*ctx, &wp, w);
  if (st != UCS_OK) die("ucp_worker_create", st);
}

static double cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

static void write_blob(int fd, const void* p, uint64_t n) {
  (void)!write(fd, &n, 8);
  (void)!write(fd, p, n);
}
static std::string read_blob(int fd) {
  uint64_t n = 0;
  if (read(fd, &n, 8) != 8) std::exit(2);
  std::string s(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, s.data() + got, n - got);
    if (r <= 0) std::exit(2);
    got += r;
  }
  return s;
}

int main(int argc, char** argv) {
  const size_t size = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (64u << 20);
  const bool peer_mode = argc > 2 && std::string(argv[2]) == "peer";
  const bool owner_progress = argc > 3 && std::string(argv[3]) == "progress";
  const bool ucx_alloc = argc > 4 && std::string(argv[4]) == "alloc";
  int to_child[2], to_parent[2];
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) return 1;
  pid_t pid = fork();
  if (pid != 0) {  // owner
    ucp_context_h ctx;
    ucp_worker_h w;
    setup(&ctx, &w);
    ucp_worker_h w_ = w;
    std::vector<unsigned char> own(ucx_alloc ? 0 : size);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = ucx_alloc ? nullptr : own.data();
    mp.length = size;
    mp.flags = ucx_alloc ? UCP_MEM_MAP_ALLOCATE : 0;
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map(ctx, &mp, &memh);
    if (st != UCS_OK) die("ucp_mem_map", st);
    ucp_mem_attr_t ma{};
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    ucp_mem_query(memh, &ma);
    struct View { unsigned char* p; unsigned char* data() { return p; } } buf{static_cast<unsigned char*>(ma.address)};
    for (size_t i = 0; i < size; ++i) buf.p[i] = static_cast<unsigned char>(i * 7 + (i >> 12));
    void* rkey_buf;
    size_t rkey_len;
    st = ucp_rkey_pack(ctx, memh, &rkey_buf, &rkey_len);
    if (st != UCS_OK) die("ucp_rkey_pack", st);
    ucp_address_t* addr;
    size_t addr_len;
    st = ucp_worker_get_address(w, &addr, &addr_len);
    if (st != UCS_OK) die("ucp_worker_get_address", st);
    write_blob(to_child[1], addr, addr_len);
    write_blob(to_child[1], rkey_buf, rkey_len);
    uint64_t remote = reinterpret_cast<uint64_t>(buf.data());
    write_blob(to_child[1], &remote, 8);
    std::printf("owner: rkey %zu bytes, worker address %zu bytes\n", rkey_len, addr_len);
    std::fflush(stdout);
    // Progress until the puller's warm-up get (endpoint wire-up) is done.
    {
      char w = 0;
      fd_set fds;
      for (;;) {
        ucp_worker_progress(w_);
        FD_ZERO(&fds);
        FD_SET(to_parent[0], &fds);
        timeval tv{0, 1000};
        if (select(to_parent[0] + 1, &fds, nullptr, nullptr, &tv) > 0) break;
      }
      (void)!read(to_parent[0], &w, 1);
    }
    const double c0 = cpu_s();
    // Wait for the child's "done" byte, progressing or not.
    char done = 0;
    if (owner_progress) {
      fd_set fds;
      for (;;) {
        ucp_worker_progress(w);
        FD_ZERO(&fds);
        FD_SET(to_parent[0], &fds);
        timeval tv{0, 0};
        if (select(to_parent[0] + 1, &fds, nullptr, nullptr, &tv) > 0) break;
      }
    }
    (void)!read(to_parent[0], &done, 1);
    const double c1 = cpu_s();
    int status = 0;
    waitpid(pid, &status, 0);
    std::printf("owner: cpu during pull %.3f ms (%s); child exit %d\n", (c1 - c0) * 1e3,
                owner_progress ? "progressing" : "not progressing", WEXITSTATUS(status));
    return 0;
  }
  // puller
  ucp_context_h ctx;
  ucp_worker_h w;
  setup(&ctx, &w);
  std::string addr = read_blob(to_child[0]);
  std::string rkey_buf = read_blob(to_child[0]);
  std::string remote_s = read_blob(to_child[0]);
  uint64_t remote;
  std::memcpy(&remote, remote_s.data(), 8);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
  ep.err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ucp_ep_h e;
  ucs_status_t st = ucp_ep_create(w, &ep, &e);
  if (st != UCS_OK) die("ucp_ep_create", st);
  ucp_rkey_h rkey;
  st = ucp_ep_rkey_unpack(e, rkey_buf.data(), &rkey);
  if (st != UCS_OK) die("ucp_ep_rkey_unpack", st);
  std::vector<unsigned char> dst(size);
  {
    void* local = nullptr;
    ucs_status_t rp_st = ucp_rkey_ptr(rkey, remote, &local);
    std::printf("puller: ucp_rkey_ptr: %s\n", ucs_status_string(rp_st));
    if (rp_st == UCS_OK) {
      for (int round = 0; round < 3; ++round) {
        const double c0 = cpu_s();
        auto t0 = std::chrono::steady_clock::now();
        std::memcpy(dst.data(), local, size);
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        size_t bad = 0;
        for (size_t i = 0; i < size; ++i) bad += dst[i] != static_cast<unsigned char>(i * 7 + (i >> 12));
        std::printf("puller: rkey_ptr round %d: %.2f ms (%.2f GB/s), cpu %.2f ms, %zu wrong\n", round, secs * 1e3,
                    size / secs / 1e9, (cpu_s() - c0) * 1e3, bad);
      }
    }
  }
  {  // warm-up: a 1-byte get while the owner progresses (wire-up)
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_get_nbx(e, dst.data(), 1, remote, rkey, &rp);
    if (UCS_PTR_IS_ERR(req)) die("warm-up get", UCS_PTR_STATUS(req));
    if (req != nullptr) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(w);
      ucp_request_free(req);
    }
    (void)!write(to_parent[1], "w", 1);
  }
  for (int round = 0; round < 3; ++round) {
    std::memset(dst.data(), 0, size);
    const double c0 = cpu_s();
    auto t0 = std::chrono::steady_clock::now();
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_get_nbx(e, dst.data(), size, remote, rkey, &rp);
    if (UCS_PTR_IS_ERR(req)) die("ucp_get_nbx", UCS_PTR_STATUS(req));
    if (req != nullptr) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS) {
        ucp_worker_progress(w);
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10)) {
          std::printf("puller: get did not complete in 10 s (owner not progressing?)\n");
          (void)!write(to_parent[1], "x", 1);
          return 3;
        }
      }
      st = ucp_request_check_status(req);
      ucp_request_free(req);
      if (st != UCS_OK) die("get", st);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    size_t bad = 0;
    for (size_t i = 0; i < size; ++i) bad += dst[i] != static_cast<unsigned char>(i * 7 + (i >> 12));
    std::printf("puller: round %d: %zu bytes in %.2f ms (%.2f GB/s), puller cpu %.2f ms, %zu wrong bytes\n", round,
                size, secs * 1e3, size / secs / 1e9, (cpu_s() - c0) * 1e3, bad);
  }
  ucp_ep_print_info(e, stdout);
  (void)!write(to_parent[1], "x", 1);
  return 0;
}
