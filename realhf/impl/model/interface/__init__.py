"""Model interfaces (register themselves on import)."""
import realhf.impl.model.interface.dpo_interface  # noqa: F401
import realhf.impl.model.interface.gen_interface  # noqa: F401
import realhf.impl.model.interface.math_reward_interface  # noqa: F401
import realhf.impl.model.interface.ppo_interface  # noqa: F401
import realhf.impl.model.interface.rw_interface  # noqa: F401
import realhf.impl.model.interface.sft_interface  # noqa: F401
