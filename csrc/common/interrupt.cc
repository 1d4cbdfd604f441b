#include "common/interrupt.h"

namespace argrpc {

WaitInterrupt*& current_interrupt() {
  thread_local WaitInterrupt* check = nullptr;
  return check;
}

WaitHook*& current_wait_hook() {
  thread_local WaitHook* hook = nullptr;
  return hook;
}

}  // namespace argrpc
