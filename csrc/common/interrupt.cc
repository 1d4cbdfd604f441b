#include "common/interrupt.h"

namespace argrpc {

WaitInterrupt*& current_interrupt() {
  thread_local WaitInterrupt* check = nullptr;
  return check;
}

}  // namespace argrpc
