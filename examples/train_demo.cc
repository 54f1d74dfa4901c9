// ckpt-train-demo: a stand-in trainer rank that checkpoints through ckpt.
//
// Its "model" is a few float32 tensors that every step updates with a
// deterministic rule (a cheap stand-in for an optimizer step), so a run that
// crashes and resumes from a checkpoint must end with exactly the state of an
// uninterrupted run; the program checks that itself at the end.
//
//   ckpt-train-demo --meta HOST:PORT --agent-socket PATH --job ID --rank R --world-size W
//                   [--steps 20] [--every 2] [--mib 64] [--crash-at STEP] [--resume]
//                   [--flush-every N]
//
// --crash-at S: after the checkpoint of step S is committed (the agent holds
// it: SaveHandle::Committed), the process kills
// itself with SIGKILL (what a node-local failure looks like to ckpt).
// --resume: start from the newest PROTECTED version instead of step 0.
// Output: one line per save (blocking time), where the restore came from,
// and "final state matches an uninterrupted run: yes|NO".
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "ckpt/client.h"
#include "common/crc32c.h"

namespace {

constexpr int kTensors = 4;

struct Args {
  std::string meta, socket, job;
  uint32_t rank = 0, world = 1;
  uint64_t steps = 20, every = 2, mib = 64, crash_at = 0, flush_every = 0;
  bool resume = false;
};

// The deterministic "training" update of one step.
void Step(std::vector<std::vector<float>>& state, uint64_t step, uint32_t rank) {
  for (size_t t = 0; t < state.size(); ++t) {
    std::vector<float>& w = state[t];
    const float lr = 1.0f / static_cast<float>(step + 10);
    for (size_t i = 0; i < w.size(); ++i) {
      w[i] = w[i] * (1.0f - lr) + lr * static_cast<float>((i * 31 + t * 7 + step * 13 + rank) % 1000) / 1000.0f;
    }
  }
}

std::vector<std::vector<float>> Init(const Args& a) {
  const size_t n = a.mib * (1 << 20) / sizeof(float) / kTensors;
  std::vector<std::vector<float>> s(kTensors, std::vector<float>(n, 0.0f));
  return s;
}

uint32_t Digest(const std::vector<std::vector<float>>& s) {
  uint32_t crc = 0;
  for (const auto& w : s) crc = ckpt::Crc32cExtend(crc, w.data(), w.size() * sizeof(float));
  return crc;
}

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "rank: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int Run(const Args& a) {
  ckpt::ClientOptions o;
  o.meta_address = a.meta;
  o.agent_socket = a.socket;
  o.job_id = a.job;
  o.rank = a.rank;
  o.world_size = a.world;
  o.flush_every_n_versions = static_cast<uint32_t>(a.flush_every);
  absl::StatusOr<ckpt::Client> client = ckpt::Client::Connect(o);
  if (!client.ok()) return Fail(client.status(), "connect");

  std::vector<std::vector<float>> state = Init(a);
  uint64_t start = 0;
  if (a.resume) {
    absl::StatusOr<uint64_t> latest = client->Latest(ckpt::Level::kProtected);
    if (!latest.ok()) return Fail(latest.status(), "latest");
    std::map<std::string, std::span<std::byte>> buffers;
    for (int t = 0; t < kTensors; ++t) {
      buffers[absl::StrCat("layer", t, ".weight")] =
          std::as_writable_bytes(std::span<float>(state[t].data(), state[t].size()));
    }
    // Zero-copy open first, to learn where the bytes came from, then copy
    // into the live tensors with every crc checked.
    absl::StatusOr<ckpt::LoadedShard> shard = client->Load(*latest);
    if (!shard.ok()) return Fail(shard.status(), "load");
    const char* from = ckpt::ServedFromName(shard->served_from());
    shard->Close().IgnoreError();
    const absl::Time t0 = absl::Now();
    if (absl::Status s = client->LoadInto(*latest, buffers); !s.ok()) return Fail(s, "load into");
    std::printf("rank %u: resumed from step %lu (served from %s) in %.1f ms\n", a.rank,
                static_cast<unsigned long>(*latest), from, absl::ToDoubleMilliseconds(absl::Now() - t0));
    start = *latest;
  }
  std::optional<ckpt::SaveHandle> previous;
  for (uint64_t step = start + 1; step <= a.steps; ++step) {
    Step(state, step, a.rank);
    if (step % a.every != 0) continue;
    // Bound checkpoints in flight to one, as trainers do: the previous one
    // must be PROTECTED (by then meta has told agents to evict what retention
    // no longer keeps). In a real job this overlaps the training step.
    if (previous) {
      if (absl::Status s = previous->Wait(ckpt::Level::kProtected, absl::Now() + absl::Minutes(2)); !s.ok()) {
        return Fail(s, "wait for the previous checkpoint");
      }
    }
    const absl::Time t0 = absl::Now();
    ckpt::SaveBuilder b = client->BeginSave(step);
    for (int t = 0; t < kTensors; ++t) {
      absl::Status s = b.Add(absl::StrCat("layer", t, ".weight"),
                             std::as_bytes(std::span<const float>(state[t].data(), state[t].size())),
                             ckpt::DType::kF32, {state[t].size()});
      if (!s.ok()) return Fail(s, "add");
    }
    absl::StatusOr<ckpt::SaveHandle> h = b.Commit();
    if (!h.ok()) return Fail(h.status(), "commit");
    previous = *h;
    std::printf("rank %u: step %lu saved %lu MiB, training blocked %.1f ms\n", a.rank,
                static_cast<unsigned long>(step), static_cast<unsigned long>(a.mib),
                absl::ToDoubleMilliseconds(absl::Now() - t0));
    std::fflush(stdout);
    if (step == a.crash_at) {
      // Commit returned after the copy; the crash comes once the agent holds
      // the shard (as a crash in the next training step would).
      if (absl::Status s = h->Committed(absl::Now() + absl::Minutes(1)); !s.ok()) return Fail(s, "commit");
      std::printf("rank %u: crashing now (SIGKILL) after committing step %lu\n", a.rank,
                  static_cast<unsigned long>(step));
      std::fflush(stdout);
      ::kill(::getpid(), SIGKILL);
    }
  }
  // The same run without any checkpoint or crash.
  std::vector<std::vector<float>> reference = Init(a);
  for (uint64_t step = 1; step <= a.steps; ++step) Step(reference, step, a.rank);
  const bool same = Digest(reference) == Digest(state);
  std::printf("rank %u: final state matches an uninterrupted run: %s\n", a.rank, same ? "yes" : "NO");
  return same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", f.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--meta") a.meta = next();
    else if (f == "--agent-socket") a.socket = next();
    else if (f == "--job") a.job = next();
    else if (f == "--rank") a.rank = static_cast<uint32_t>(std::stoul(next()));
    else if (f == "--world-size") a.world = static_cast<uint32_t>(std::stoul(next()));
    else if (f == "--steps") a.steps = std::stoull(next());
    else if (f == "--every") a.every = std::max<uint64_t>(1, std::stoull(next()));
    else if (f == "--mib") a.mib = std::max<uint64_t>(1, std::stoull(next()));
    else if (f == "--crash-at") a.crash_at = std::stoull(next());
    else if (f == "--flush-every") a.flush_every = std::stoull(next());
    else if (f == "--resume") a.resume = true;
    else {
      std::fprintf(stderr,
                   "usage: ckpt-train-demo --meta HOST:PORT --agent-socket PATH --job ID --rank R "
                   "--world-size W [--steps N] [--every N] [--mib N] [--crash-at STEP] [--resume] "
                   "[--flush-every N]\n");
      return 2;
    }
  }
  if (a.meta.empty() || a.socket.empty() || a.job.empty()) {
    std::fprintf(stderr, "ckpt-train-demo: --meta, --agent-socket and --job are required\n");
    return 2;
  }
  return Run(a);
}
