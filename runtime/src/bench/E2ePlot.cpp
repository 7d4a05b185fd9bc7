// writeE2ePlot: a small line chart rasterised here and stored as a PNG (stored deflate blocks, so
// no compression library): one colour per batch size, TPOT solid with square markers, the floor
// dashed, context on a log2 axis, tick labels in a 3x5 pixel font scaled up.
#include "hybrid/runtime/E2eBench.h"

#include "hybrid/runtime/UniqueFd.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <initializer_list>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

namespace hybrid::bench {
namespace {

constexpr int kWidth = 880, kHeight = 520;
constexpr int kLeft = 80, kRight = 150, kTop = 30, kBottom = 60; // plot area margins
constexpr int kScale = 3;                                        // font pixels per glyph pixel

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrey{215, 215, 215};
constexpr std::array<Rgb, 6> kPalette = {
    {{31, 119, 180}, {214, 39, 40}, {44, 160, 44}, {255, 127, 14}, {148, 103, 189}, {140, 86, 75}}};

// 3x5 glyphs, rows top to bottom, 3 bits each (bit 2 = left column).
const std::map<char, std::array<uint8_t, 5>> &glyphs() {
  static const std::map<char, std::array<uint8_t, 5>> table = {
      {'0', {7, 5, 5, 5, 7}}, {'1', {2, 6, 2, 2, 7}}, {'2', {7, 1, 7, 4, 7}},
      {'3', {7, 1, 7, 1, 7}}, {'4', {5, 5, 7, 1, 1}}, {'5', {7, 4, 7, 1, 7}},
      {'6', {7, 4, 7, 5, 7}}, {'7', {7, 1, 1, 1, 1}}, {'8', {7, 5, 7, 5, 7}},
      {'9', {7, 5, 7, 1, 7}}, {'.', {0, 0, 0, 0, 2}}, {'K', {5, 5, 6, 5, 5}},
      {'M', {5, 7, 7, 5, 5}}, {'b', {4, 4, 7, 5, 7}}, {'=', {0, 7, 0, 7, 0}},
      {'m', {0, 0, 7, 7, 5}}, {'s', {0, 3, 6, 1, 6}}, {'-', {0, 0, 7, 0, 0}},
      {'T', {7, 2, 2, 2, 2}}, {'P', {7, 5, 7, 4, 4}}, {'O', {7, 5, 5, 5, 7}},
      {'c', {0, 7, 4, 4, 7}}, {'o', {0, 7, 5, 5, 7}}, {'n', {0, 6, 5, 5, 5}},
      {'t', {2, 7, 2, 2, 3}}, {'e', {7, 5, 7, 4, 7}}, {'x', {0, 5, 2, 5, 0}},
      {'f', {3, 4, 6, 4, 4}}, {'l', {2, 2, 2, 2, 3}}, {'r', {0, 7, 4, 4, 4}},
      {' ', {0, 0, 0, 0, 0}}};
  return table;
}

class Canvas {
public:
  Canvas() : pixels_(size_t(kWidth) * kHeight, kWhite) {}
  void set(int x, int y, Rgb c) {
    if (x >= 0 && y >= 0 && x < kWidth && y < kHeight)
      pixels_[size_t(y) * kWidth + size_t(x)] = c;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x)
        set(x, y, c);
  }
  // A 2-pixel line; `dash` > 0: on and off runs of that many steps.
  void line(double x0, double y0, double x1, double y1, Rgb c, int dash = 0) {
    const int steps = int(std::max(std::fabs(x1 - x0), std::fabs(y1 - y0))) + 1;
    for (int i = 0; i <= steps; ++i) {
      if (dash > 0 && (i / dash) % 2 == 1)
        continue;
      const double t = double(i) / steps;
      const int x = int(std::lround(x0 + t * (x1 - x0))), y = int(std::lround(y0 + t * (y1 - y0)));
      fill(x, y, x + 1, y + 1, c);
    }
  }
  void text(int x, int y, const std::string &s, Rgb c) {
    for (char ch : s) {
      auto found = glyphs().find(ch);
      if (found != glyphs().end())
        for (int row = 0; row < 5; ++row)
          for (int col = 0; col < 3; ++col)
            if (found->second[size_t(row)] >> (2 - col) & 1)
              fill(x + col * kScale, y + row * kScale, x + col * kScale + kScale - 1,
                   y + row * kScale + kScale - 1, c);
      x += 4 * kScale;
    }
  }
  static int textWidth(const std::string &s) { return int(s.size()) * 4 * kScale; }
  const std::vector<Rgb> &pixels() const { return pixels_; }

private:
  std::vector<Rgb> pixels_;
};

uint32_t crc32(const uint8_t *data, size_t n, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i)
    crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

void putBig32(std::vector<uint8_t> &out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out.push_back(uint8_t(v >> shift));
}

void chunk(std::vector<uint8_t> &png, const char *type, const std::vector<uint8_t> &data) {
  putBig32(png, uint32_t(data.size()));
  const size_t start = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  putBig32(png, crc32(png.data() + start, png.size() - start));
}

// The image as a PNG: 8-bit RGB, filter 0 rows, a zlib stream of stored deflate blocks.
std::vector<uint8_t> encodePng(const Canvas &canvas) {
  std::vector<uint8_t> raw;
  raw.reserve(size_t(kHeight) * (1 + 3 * size_t(kWidth)));
  for (int y = 0; y < kHeight; ++y) {
    raw.push_back(0);
    for (int x = 0; x < kWidth; ++x) {
      const Rgb &p = canvas.pixels()[size_t(y) * kWidth + size_t(x)];
      raw.insert(raw.end(), {p.r, p.g, p.b});
    }
  }
  std::vector<uint8_t> z = {0x78, 0x01};
  for (size_t at = 0; at < raw.size();) {
    const size_t n = std::min<size_t>(65535, raw.size() - at);
    z.push_back(at + n == raw.size() ? 1 : 0);
    z.insert(z.end(), {uint8_t(n), uint8_t(n >> 8), uint8_t(~n), uint8_t(~n >> 8)});
    z.insert(z.end(), raw.begin() + long(at), raw.begin() + long(at + n));
    at += n;
  }
  uint32_t a = 1, b = 0; // Adler-32
  for (uint8_t byte : raw) {
    a = (a + byte) % 65521;
    b = (b + a) % 65521;
  }
  putBig32(z, (b << 16) | a);
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> header;
  putBig32(header, kWidth);
  putBig32(header, kHeight);
  header.insert(header.end(), {8, 2, 0, 0, 0});
  chunk(png, "IHDR", header);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", {});
  return png;
}

std::string contextLabel(int64_t context) {
  if (context >= (1 << 20) && context % (1 << 20) == 0)
    return std::to_string(context >> 20) + "M";
  if (context >= 1024 && context % 1024 == 0)
    return std::to_string(context >> 10) + "K";
  return std::to_string(context);
}

std::string numberLabel(double value) {
  char text[32];
  std::snprintf(text, sizeof text, value >= 10 ? "%.0f" : value >= 1 ? "%.1f" : "%.2f", value);
  return text;
}

} // namespace

Status writeE2ePlot(const std::vector<E2eRow> &rows, const std::string &path) {
  if (rows.empty())
    return Status::error(path + ": no rows to plot");
  std::map<int64_t, std::vector<const E2eRow *>> byBatch;
  double xMin = 1e300, xMax = -1e300, yMax = 0;
  for (const E2eRow &row : rows) {
    byBatch[row.batch].push_back(&row);
    xMin = std::min(xMin, std::log2(double(row.context)));
    xMax = std::max(xMax, std::log2(double(row.context)));
    yMax = std::max({yMax, row.tpotUs / 1e3, row.floorUs / 1e3});
  }
  if (xMax - xMin < 1) {
    xMin -= 0.5;
    xMax += 0.5;
  }
  yMax = yMax > 0 ? yMax * 1.1 : 1;
  const int plotW = kWidth - kLeft - kRight, plotH = kHeight - kTop - kBottom;
  auto px = [&](double log2Context) { return kLeft + (log2Context - xMin) / (xMax - xMin) * plotW; };
  auto py = [&](double ms) { return kTop + plotH - ms / yMax * plotH; };

  Canvas canvas;
  for (int i = 0; i <= 4; ++i) { // y grid and labels (ms)
    const double ms = yMax * i / 4;
    canvas.line(kLeft, py(ms), kLeft + plotW, py(ms), kGrey);
    const std::string label = numberLabel(ms);
    canvas.text(kLeft - 10 - Canvas::textWidth(label), int(py(ms)) - 7, label, kBlack);
  }
  std::map<int64_t, bool> contexts;
  for (const E2eRow &row : rows)
    contexts[row.context] = true;
  for (const auto &[context, unused] : contexts) { // x ticks
    const double x = px(std::log2(double(context)));
    canvas.line(x, kTop + plotH, x, kTop + plotH + 6, kBlack);
    const std::string label = contextLabel(context);
    canvas.text(int(x) - Canvas::textWidth(label) / 2, kTop + plotH + 12, label, kBlack);
  }
  canvas.line(kLeft, kTop, kLeft, kTop + plotH, kBlack);
  canvas.line(kLeft, kTop + plotH, kLeft + plotW, kTop + plotH, kBlack);
  canvas.text(kLeft - 60, 8, "TPOT ms", kBlack);
  canvas.text(kLeft + plotW / 2 - Canvas::textWidth("context") / 2, kHeight - 22, "context",
              kBlack);

  size_t colour = 0;
  int legendY = kTop + 10;
  for (auto &[batch, series] : byBatch) {
    std::sort(series.begin(), series.end(),
              [](const E2eRow *a, const E2eRow *b) { return a->context < b->context; });
    const Rgb c = kPalette[colour++ % kPalette.size()];
    for (size_t i = 0; i < series.size(); ++i) {
      const double x = px(std::log2(double(series[i]->context)));
      canvas.fill(int(x) - 3, int(py(series[i]->tpotUs / 1e3)) - 3, int(x) + 3,
                  int(py(series[i]->tpotUs / 1e3)) + 3, c);
      if (i + 1 < series.size()) {
        const double x1 = px(std::log2(double(series[i + 1]->context)));
        canvas.line(x, py(series[i]->tpotUs / 1e3), x1, py(series[i + 1]->tpotUs / 1e3), c);
        canvas.line(x, py(series[i]->floorUs / 1e3), x1, py(series[i + 1]->floorUs / 1e3), c, 6);
      }
    }
    canvas.fill(kLeft + plotW + 15, legendY, kLeft + plotW + 35, legendY + 14, c);
    canvas.text(kLeft + plotW + 42, legendY, "b=" + std::to_string(batch), kBlack);
    legendY += 26;
  }
  canvas.line(kLeft + plotW + 15, legendY + 7, kLeft + plotW + 35, legendY + 7, kBlack, 4);
  canvas.text(kLeft + plotW + 42, legendY, "floor", kBlack);

  const std::vector<uint8_t> png = encodePng(canvas);
  // Written beside the target and renamed: a reader never sees half a file.
  const std::string temp = path + ".tmp";
  UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.isOpen())
    return Status::error(path + ": cannot create: " + std::strerror(errno));
  for (size_t at = 0; at < png.size();) {
    const ssize_t n = ::write(fd.get(), png.data() + at, png.size() - at);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::unlink(temp.c_str());
      return Status::error(path + ": write failed: " + why);
    }
    at += size_t(n);
  }
  if (fd.closeNow() != 0 || ::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    return Status::error(path + ": " + why);
  }
  return Status::ok();
}

} // namespace hybrid::bench
