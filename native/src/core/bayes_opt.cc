#include "core/bayes_opt.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>

namespace sdl {

double GaussianProcess::Kernel(const std::vector<double>& a, const std::vector<double>& b) const {
  double d2 = 0;
  for (size_t i = 0; i < a.size(); ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  return std::exp(-d2 / (2 * length_ * length_));
}

void GaussianProcess::Fit(const std::vector<std::vector<double>>& xs, const std::vector<double>& ys) {
  const size_t n = xs.size();
  if (n == 0 || ys.size() != n) throw std::invalid_argument("GaussianProcess::Fit: bad sample count");
  xs_ = xs;
  y_mean_ = 0;
  for (double y : ys) y_mean_ += y;
  y_mean_ /= static_cast<double>(n);
  double var = 0;
  for (double y : ys) var += (y - y_mean_) * (y - y_mean_);
  y_std_ = std::sqrt(var / static_cast<double>(n));
  if (!(y_std_ > 0)) y_std_ = 1;  // one sample, or all equal
  // K + noise I, factored in place (Cholesky-Banachiewicz).
  chol_.assign(n * n, 0);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j <= i; ++j) {
      double s = Kernel(xs[i], xs[j]) + (i == j ? noise_ : 0);
      for (size_t k = 0; k < j; ++k) s -= chol_[i * n + k] * chol_[j * n + k];
      if (i == j) chol_[i * n + i] = std::sqrt(std::max(s, 1e-12));
      else chol_[i * n + j] = s / chol_[j * n + j];
    }
  // alpha = L^-T L^-1 y
  std::vector<double> z(n);
  for (size_t i = 0; i < n; ++i) {
    double s = (ys[i] - y_mean_) / y_std_;
    for (size_t k = 0; k < i; ++k) s -= chol_[i * n + k] * z[k];
    z[i] = s / chol_[i * n + i];
  }
  alpha_.assign(n, 0);
  for (size_t i = n; i-- > 0;) {
    double s = z[i];
    for (size_t k = i + 1; k < n; ++k) s -= chol_[k * n + i] * alpha_[k];
    alpha_[i] = s / chol_[i * n + i];
  }
}

void GaussianProcess::Predict(const std::vector<double>& x, double* mean, double* stddev) const {
  const size_t n = xs_.size();
  std::vector<double> k(n);
  double mu = 0;
  for (size_t i = 0; i < n; ++i) {
    k[i] = Kernel(x, xs_[i]);
    mu += k[i] * alpha_[i];
  }
  // var = k(x, x) - v.v with v = L^-1 k
  double vv = 0;
  for (size_t i = 0; i < n; ++i) {
    double s = k[i];
    for (size_t j = 0; j < i; ++j) s -= chol_[i * n + j] * k[j];
    k[i] = s / chol_[i * n + i];  // k now holds v
    vv += k[i] * k[i];
  }
  *mean = mu * y_std_ + y_mean_;
  *stddev = std::sqrt(std::max(1.0 - vv, 0.0)) * y_std_;
}

double ExpectedImprovement(double mean, double stddev, double best, double xi) {
  const double gain = mean - best - xi;
  if (stddev <= 1e-12) return std::max(gain, 0.0);
  const double z = gain / stddev;
  const double cdf = 0.5 * std::erfc(-z / std::sqrt(2.0));
  const double pdf = std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
  return gain * cdf + stddev * pdf;
}

BayesOpt::BayesOpt(int dims, double noise, uint64_t seed, int candidates)
    : dims_(dims), noise_(noise) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  if (dims_ <= 12)
    for (int c = 0; c < (1 << dims_); ++c) {
      std::vector<double> corner(dims_);
      for (int d = 0; d < dims_; ++d) corner[d] = (c >> d) & 1;
      candidates_.push_back(std::move(corner));
    }
  for (int c = 0; c < candidates; ++c) {
    std::vector<double> x(dims_);
    for (double& v : x) v = u(rng);
    candidates_.push_back(std::move(x));
  }
}

void BayesOpt::Add(const std::vector<double>& x, double score) {
  if (static_cast<int>(x.size()) != dims_) throw std::invalid_argument("BayesOpt::Add: bad dimension");
  xs_.push_back(x);
  ys_.push_back(score);
}

int BayesOpt::BestIndex() const {
  int best = -1;
  for (size_t i = 0; i < ys_.size(); ++i)
    if (best < 0 || ys_[i] > ys_[best]) best = static_cast<int>(i);
  return best;
}

std::vector<double> BayesOpt::Next() const {
  if (ys_.empty()) throw std::logic_error("BayesOpt::Next: no samples yet");
  // Length scale 0.3 of the unit cube: a sample informs its neighbourhood,
  // not the whole range (the parameters' effects are not smooth over decades).
  GaussianProcess gp(0.3, noise_);
  gp.Fit(xs_, ys_);
  const double best = ys_[BestIndex()];
  // xi: a small margin in score units (1% of the best), so that EI prefers
  // exploring over re-measuring the incumbent when both look alike.
  const double xi = 0.01 * std::fabs(best);
  const std::vector<double>* pick = &candidates_[0];
  double top = -1;
  for (const auto& c : candidates_) {
    double m, s;
    gp.Predict(c, &m, &s);
    const double ei = ExpectedImprovement(m, s, best, xi);
    if (ei > top) {
      top = ei;
      pick = &c;
    }
  }
  return *pick;
}

}  // namespace sdl
