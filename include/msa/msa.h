// Umbrella header of the MSA C++ API.
#pragma once

#include "msa/api.h"
#include "msa/params.h"
#include "msa/types.h"
