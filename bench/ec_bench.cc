// Erasure-coding throughput of ckpt::ec::Codec next to raw ISA-L calls on the
// same buffers, in the same binary and run, for RS(4,2), RS(8,2), RS(8,3) with
// 1 MiB segments: encode, decode of 1 and of m lost fragments, and incremental
// update (one data segment folded into the parity).
//
// Prints Google Benchmark's table, then one line per case:
//   case  ours GB/s  raw GB/s  ratio (goal >= 0.95)
// Exit status 0 (the ratio is reported, not asserted: machines are noisy).
//
//   build/bench/ec_bench [--benchmark_repetitions=N] [--benchmark_min_time=S]
// (defaults: 9 repetitions, randomly interleaved, 0.1 s each; medians compared)
#include <benchmark/benchmark.h>
#include <isa-l/erasure_code.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ec/codec.h"

namespace {

constexpr size_t kSegment = 1 << 20;
// Stripes rotated through so that data comes from DRAM, not cache.
constexpr size_t kWorkingSetBytes = size_t{128} << 20;

struct Fixture {
  int k, m, stripes;
  std::vector<std::vector<uint8_t>> data;    // stripes * k
  std::vector<std::vector<uint8_t>> parity;  // stripes * m
  std::vector<std::vector<uint8_t>> out;     // m rebuilt fragments
  std::unique_ptr<ckpt::ec::Codec> codec;
  std::vector<uint8_t> encode_tables;
  std::vector<uint8_t> generator;

  Fixture(int k_, int m_) : k(k_), m(m_) {
    stripes = std::max<int>(2, kWorkingSetBytes / (kSegment * (k + m)));
    std::mt19937_64 rng(k * 100 + m);
    data.resize(stripes * k, std::vector<uint8_t>(kSegment));
    parity.resize(stripes * m, std::vector<uint8_t>(kSegment));
    out.resize(m, std::vector<uint8_t>(kSegment));
    for (auto& d : data)
      for (auto& b : d) b = static_cast<uint8_t>(rng());
    codec = std::move(ckpt::ec::Codec::Create(k, m)).value();
    generator.resize((k + m) * k);
    gf_gen_cauchy1_matrix(generator.data(), k + m, k);
    encode_tables.resize(32 * k * m);
    ec_init_tables(k, m, generator.data() + k * k, encode_tables.data());
    for (int s = 0; s < stripes; ++s) {
      std::vector<uint8_t*> src, dst;
      for (int i = 0; i < k; ++i) src.push_back(data[s * k + i].data());
      for (int j = 0; j < m; ++j) dst.push_back(parity[s * m + j].data());
      ec_encode_data(kSegment, k, m, encode_tables.data(), src.data(), dst.data());
    }
  }

  // Raw ISA-L decode tables for losing fragments 0..lost-1 (data), using the
  // next k fragments as survivors: the textbook recipe from ISA-L's examples.
  std::vector<uint8_t> RawDecodeTables(int lost) const {
    std::vector<uint8_t> b(k * k), inv(k * k), rows(lost * k), tables(32 * k * lost);
    for (int r = 0; r < k; ++r) std::memcpy(&b[r * k], &generator[(lost + r) * k], k);
    gf_invert_matrix(b.data(), inv.data(), k);
    for (int x = 0; x < lost; ++x) std::memcpy(&rows[x * k], &inv[x * k], k);
    ec_init_tables(k, lost, rows.data(), tables.data());
    return tables;
  }

  uint8_t* Frag(int s, int idx) {
    return idx < k ? data[s * k + idx].data() : parity[s * m + (idx - k)].data();
  }
};

Fixture& Get(int k, int m) {
  static std::map<std::pair<int, int>, std::unique_ptr<Fixture>> fixtures;
  auto& f = fixtures[{k, m}];
  if (!f) f = std::make_unique<Fixture>(k, m);
  return *f;
}

void BM_Encode(benchmark::State& state, bool raw) {
  Fixture& f = Get(state.range(0), state.range(1));
  int s = 0;
  std::vector<ckpt::ec::ConstBuffer> in(f.k);
  std::vector<ckpt::ec::MutableBuffer> outv(f.m);
  std::vector<uint8_t*> src(f.k), dst(f.m);
  for (auto _ : state) {
    if (raw) {
      for (int i = 0; i < f.k; ++i) src[i] = f.Frag(s, i);
      for (int j = 0; j < f.m; ++j) dst[j] = f.Frag(s, f.k + j);
      ec_encode_data(kSegment, f.k, f.m, f.encode_tables.data(), src.data(), dst.data());
    } else {
      for (int i = 0; i < f.k; ++i) in[i] = {f.Frag(s, i), kSegment};
      for (int j = 0; j < f.m; ++j) outv[j] = {f.Frag(s, f.k + j), kSegment};
      if (!f.codec->Encode(in, outv).ok()) state.SkipWithError("encode failed");
    }
    s = (s + 1) % f.stripes;
  }
  state.SetBytesProcessed(state.iterations() * f.k * kSegment);
}

// Decodes `lost` data fragments (0..lost-1) from the next k fragments.
void BM_Decode(benchmark::State& state, int lost_arg, bool raw) {
  Fixture& f = Get(state.range(0), state.range(1));
  const int lost = lost_arg < 0 ? f.m : lost_arg;
  const std::vector<uint8_t> tables = f.RawDecodeTables(lost);
  int s = 0;
  std::vector<uint8_t*> src(f.k), dst(lost);
  std::vector<ckpt::ec::Fragment> frags(f.k + f.m);
  for (auto _ : state) {
    if (raw) {
      for (int i = 0; i < f.k; ++i) src[i] = f.Frag(s, lost + i);
      for (int x = 0; x < lost; ++x) dst[x] = f.out[x].data();
      ec_encode_data(kSegment, f.k, lost, const_cast<uint8_t*>(tables.data()), src.data(), dst.data());
    } else {
      for (int i = 0; i < f.k + f.m; ++i) {
        frags[i] = i < lost ? ckpt::ec::Fragment{f.out[i].data(), kSegment, false}
                            : ckpt::ec::Fragment{f.Frag(s, i), kSegment, true};
      }
      if (!f.codec->Decode(frags, kSegment).ok()) state.SkipWithError("decode failed");
    }
    s = (s + 1) % f.stripes;
  }
  state.SetBytesProcessed(state.iterations() * f.k * kSegment);
}

// Folds one data segment into the stripe's parity.
void BM_Update(benchmark::State& state, bool raw) {
  Fixture& f = Get(state.range(0), state.range(1));
  int s = 0, i = 0;
  std::vector<uint8_t*> dst(f.m);
  std::vector<ckpt::ec::MutableBuffer> outv(f.m);
  for (auto _ : state) {
    if (raw) {
      for (int j = 0; j < f.m; ++j) dst[j] = f.out[j].data();
      ec_encode_data_update(kSegment, f.k, f.m, i, f.encode_tables.data(), f.Frag(s, i), dst.data());
    } else {
      for (int j = 0; j < f.m; ++j) outv[j] = {f.out[j].data(), kSegment};
      if (!f.codec->EncodeUpdate(i, {f.Frag(s, i), kSegment}, outv).ok()) {
        state.SkipWithError("update failed");
      }
    }
    i = (i + 1) % f.k;
    if (i == 0) s = (s + 1) % f.stripes;
  }
  state.SetBytesProcessed(state.iterations() * kSegment);
}

// Collects the median bytes/s of every benchmark for the ratio table.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const std::string name = r.benchmark_name();
      const bool aggregate = r.run_type == Run::RT_Aggregate;
      if (aggregate && r.aggregate_name != "median") continue;
      auto it = r.counters.find("bytes_per_second");
      if (it == r.counters.end()) continue;
      std::string base = r.run_name.str();
      // With repetitions, prefer the median; without, the single run.
      if (aggregate || !medians_.count(base)) medians_[base] = it->second.value;
    }
  }
  const std::map<std::string, double>& results() const { return medians_; }

 private:
  std::map<std::string, double> medians_;
};

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::pair<int, int>> codes = {{4, 2}, {8, 2}, {8, 3}};
  struct Op {
    std::string name;
    std::function<void(benchmark::State&, bool)> fn;
  };
  const std::vector<Op> ops = {
      {"encode", [](benchmark::State& s, bool raw) { BM_Encode(s, raw); }},
      {"decode_1_lost", [](benchmark::State& s, bool raw) { BM_Decode(s, 1, raw); }},
      {"decode_m_lost", [](benchmark::State& s, bool raw) { BM_Decode(s, -1, raw); }},
      {"update", [](benchmark::State& s, bool raw) { BM_Update(s, raw); }},
  };
  // Ours and raw alternate per case so drift in machine load hits both alike.
  for (const Op& op : ops) {
    for (auto [k, m] : codes) {
      for (bool raw : {false, true}) {
        benchmark::RegisterBenchmark(
            (op.name + (raw ? "/raw" : "/ours")).c_str(),
            [fn = op.fn, raw](benchmark::State& s) { fn(s, raw); })
            ->Args({k, m})
            ->ArgNames({"k", "m"})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  // Defaults that make the ratio robust on a shared, noisy machine: several
  // repetitions, randomly interleaved between ours and raw, compared by median.
  // Flags given on the command line come later and win.
  std::vector<char*> args(argv, argv + argc);
  std::string reps = "--benchmark_repetitions=9", inter = "--benchmark_enable_random_interleaving=true",
              min_time = "--benchmark_min_time=0.1";
  args.insert(args.begin() + 1, {reps.data(), inter.data(), min_time.data()});
  argc = static_cast<int>(args.size());
  argv = args.data();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  std::printf("\n%-28s %12s %12s %8s\n", "case (1 MiB segments)", "ours GB/s", "raw GB/s", "ratio");
  bool all_met = true;
  int cases = 0;
  for (const auto& [name, ours] : reporter.results()) {
    const size_t pos = name.find("/ours");
    if (pos == std::string::npos) continue;
    std::string raw_name = name;
    raw_name.replace(pos, 5, "/raw");
    auto it = reporter.results().find(raw_name);
    if (it == reporter.results().end() || it->second <= 0) continue;
    const double ratio = ours / it->second;
    all_met = all_met && ratio >= 0.95;
    ++cases;
    std::string label = name;
    label.erase(pos, 5);
    std::printf("%-28s %12.2f %12.2f %8.3f\n", label.c_str(), ours / 1e9, it->second / 1e9, ratio);
  }
  std::printf("ec_bench: %d cases, goal ratio >= 0.95 %s\n", cases,
              all_met ? "met on every case" : "NOT met on some case (see above)");
  benchmark::Shutdown();
  return 0;
}
