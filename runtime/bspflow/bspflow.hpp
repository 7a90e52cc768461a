// Umbrella header: everything a bspflow user needs.
#pragma once

#include "bspflow/arena.hpp"
#include "bspflow/data_loader.hpp"
#include "bspflow/dataset.hpp"
#include "bspflow/device.hpp"
#include "bspflow/error.hpp"
#include "bspflow/idx.hpp"
#include "bspflow/infeed_queue.hpp"
#include "bspflow/log.hpp"
#include "bspflow/options.hpp"
#include "bspflow/outfeed_queue.hpp"
#include "bspflow/output_mode.hpp"
#include "bspflow/repeat.hpp"
#include "bspflow/run.hpp"
#include "bspflow/tensor.hpp"
#include "bspflow/topology.hpp"
#include "bspflow/tunables.hpp"
