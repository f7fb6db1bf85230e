// Bayesian optimization for the autotuner (core/autotune.h): a small Gaussian
// process regression and the expected-improvement acquisition, written here
// because the problem is tiny (a handful of dimensions, tens of samples) and
// the core takes no numerical dependency for it.
//
// Points live in the unit cube [0, 1]^d (the autotuner maps each parameter
// onto [0, 1]). The GP uses an RBF kernel k(a, b) = exp(-|a - b|^2 / (2 l^2))
// with unit signal variance on scores normalized to mean 0, standard
// deviation 1 (so the length scale and the noise term mean the same thing
// whatever the scores' units), plus `noise` on the diagonal: measured
// throughput is noisy, and the noise term keeps the Cholesky factor of K
// well conditioned when two samples sit close together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sdl {

class GaussianProcess {
 public:
  GaussianProcess(double length_scale, double noise) : length_(length_scale), noise_(noise) {}

  // Fits to points xs (each of the same dimension) with scores ys (same count,
  // at least one). Scores are normalized internally.
  void Fit(const std::vector<std::vector<double>>& xs, const std::vector<double>& ys);

  // Posterior mean and standard deviation at x, in the scores' own units.
  void Predict(const std::vector<double>& x, double* mean, double* stddev) const;

 private:
  double Kernel(const std::vector<double>& a, const std::vector<double>& b) const;

  double length_, noise_;
  std::vector<std::vector<double>> xs_;
  std::vector<double> chol_;   // lower Cholesky factor of K + noise I, row-major n x n
  std::vector<double> alpha_;  // (K + noise I)^-1 y (normalized y)
  double y_mean_ = 0, y_std_ = 1;
};

// Expected improvement of a maximization at a point with posterior mean/stddev
// over the best score so far; xi: the margin an improvement must beat.
double ExpectedImprovement(double mean, double stddev, double best, double xi);

// Proposes points to sample: fits a GP to the samples so far and returns the
// candidate with the largest expected improvement. Candidates are a fixed
// pseudo-random set (seeded: the same samples give the same proposal) plus
// the corners of the cube, since a boolean parameter lives at 0 or 1.
class BayesOpt {
 public:
  BayesOpt(int dims, double noise, uint64_t seed = 0x5d1a7u, int candidates = 2000);

  void Add(const std::vector<double>& x, double score);
  // The next point to try (requires at least one sample).
  std::vector<double> Next() const;
  // The sample with the best score so far (index into the added samples).
  int BestIndex() const;
  size_t size() const { return ys_.size(); }

 private:
  int dims_;
  double noise_;
  std::vector<std::vector<double>> candidates_;
  std::vector<std::vector<double>> xs_;
  std::vector<double> ys_;
};

}  // namespace sdl
