#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/): small valid inputs
of every shape a parser accepts, and a few near misses. Run it again only to change the
seeds; the files are checked in."""
import gzip
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, 'corpus', target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), 'wb') as f:
        f.write(data)


def idx(code, dims, payload):
    return bytes([0, 0, code, len(dims)]) + b''.join(struct.pack('>I', d) for d in dims) + payload


# IDX: every element type, 1 to 3 dimensions, an empty array, near misses.
idx_seeds = {
    'uint8_labels': idx(0x08, [5], bytes([0, 1, 2, 3, 9])),
    'uint8_images': idx(0x08, [2, 3, 3], bytes(range(18))),
    'int8': idx(0x09, [4], bytes([0x80, 0xff, 0, 0x7f])),
    'int16': idx(0x0B, [2, 2], struct.pack('>4h', -2, -1, 0, 300)),
    'int32': idx(0x0C, [3], struct.pack('>3i', -7, 0, 1 << 20)),
    'float32': idx(0x0D, [2], struct.pack('>2f', 1.5, -0.25)),
    'float64': idx(0x0E, [1, 2], struct.pack('>2d', 3.25, -1e300)),
    'empty': idx(0x08, [0, 28, 28], b''),
    'truncated': idx(0x08, [4, 4], bytes(10)),
    'too_long': idx(0x08, [2], bytes(3)),
}
for name, data in idx_seeds.items():
    put('idx', name, data)
    put('idx', name + '.gz', gzip.compress(data, mtime=0))
    put('idx_gzip', name, data)

# OutputMode::parse
for i, text in enumerate(['all', 'final', 'sum', 'every_n:1', 'every_n:4', 'every_n:18446744073709551615',
                          'every_n:0', 'every_n:', 'every_n:-3', 'ALL', 'every_n:99999999999999999999']):
    put('output_mode', 'seed%02d' % i, text.encode())


# The weights file of fuzz_weights_file.cpp's model: sections conv1 (3 values), logits (2).
def weights(values_a, values_b, model='tiny', sections=(('conv1', 3), ('logits', 2))):
    head = 'bspflow-weights 1\nmodel %s\n' % model
    head += ''.join('stage %s %d\n' % s for s in sections)
    head += 'data float32-le\n'
    return head.encode() + struct.pack('<%df' % (len(values_a) + len(values_b)), *(values_a + values_b))


put('weights_file', 'valid', weights([0.5, -1.0, 2.0], [0.0, -0.0]))
put('weights_file', 'nan', weights([0.5, float('nan'), 2.0], [0.0, 1.0]))
put('weights_file', 'inf', weights([0.5, 1.0, 2.0], [float('inf'), 1.0]))
put('weights_file', 'truncated', weights([0.5, -1.0, 2.0], [0.0, 1.0])[:-3])
put('weights_file', 'wrong_size', weights([0.5, -1.0, 2.0], [0.0, 1.0], sections=(('conv1', 4), ('logits', 1))))
put('weights_file', 'wrong_model', weights([0.5, -1.0, 2.0], [0.0, 1.0], model='conv'))
put('weights_file', 'header_only', b'bspflow-weights 1\nmodel tiny\n')
